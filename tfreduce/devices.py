"""This process's devices: making K logical CPU devices, checking tower devices.

Without GPUs, K logical CPU devices stand in for K GPUs (the example, the
benchmark and the tests all run that way). They can only be made before
TensorFlow initialises its runtime, so ``logical_devices`` is called first
thing in a program; ``tower_devices`` then checks the devices a trainer is
given against what this process has.
"""

import tensorflow as tf

from tfreduce.contract import normalize_devices

__all__ = ["logical_devices", "tower_devices", "DEFAULT_CPU_DEVICES"]

#: K when no GPU exists and no count is given: two towers, the smallest
#: data-parallel run.
DEFAULT_CPU_DEVICES = 2


def _local_key(spec):
    """(type, index) of a DeviceSpec: the part that names a local device."""
    return spec.device_type.upper(), spec.device_index


def logical_devices(num_devices=None, device_type=None):
    """The names of K devices of this process, making logical CPU devices if needed.

    CPU devices are split off the host CPU with
    ``tf.config.set_logical_device_configuration``, which works only before
    TensorFlow initialises its runtime; if that already happened, the
    logical CPU devices that exist are used.

    Args:
      num_devices: int K >= 1, or None: every GPU, or ``DEFAULT_CPU_DEVICES``
        CPU devices.
      device_type: "gpu", "cpu", or None for GPUs when the machine has any,
        else CPUs.

    Returns:
      list[str], K canonical names such as "/device:CPU:0".

    Raises:
      ValueError: fewer than K GPUs, or fewer than K logical CPU devices
        exist and TensorFlow is already initialised; an unknown device_type.
    """
    if device_type not in (None, "gpu", "cpu"):
        raise ValueError(f"device_type must be 'gpu', 'cpu' or None, got {device_type!r}")
    gpus = tf.config.list_physical_devices("GPU")
    if device_type == "gpu" or (device_type is None and gpus):
        count = len(gpus) if num_devices is None else num_devices
        if count > len(gpus):
            raise ValueError(f"only {len(gpus)} GPUs exist on this machine, {count} asked for")
        return [f"/device:GPU:{i}" for i in range(count)]
    count = DEFAULT_CPU_DEVICES if num_devices is None else num_devices
    cpu = tf.config.list_physical_devices("CPU")[0]
    if tf.config.get_logical_device_configuration(cpu) is None:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
        except RuntimeError:
            pass  # TensorFlow is already initialised: what exists is checked below.
    existing = tf.config.list_logical_devices("CPU")
    if len(existing) < count:
        raise ValueError(
            f"only {len(existing)} logical CPU devices exist and TensorFlow is already "
            f"initialised, so no more can be made; configure more before TensorFlow "
            f"starts or ask for fewer")
    return [tf.DeviceSpec.from_string(d.name).to_string() for d in existing[:count]]


def tower_devices(devices):
    """Checks device names against this process's logical devices.

    Args:
      devices: None, or a non-empty list of device strings such as "/gpu:0".

    Returns:
      list[str], K canonical names ("/device:GPU:0"), in the given order;
      for None every GPU, or every CPU when there is no GPU.

    Raises:
      TypeError: devices is not a list of strings.
      ValueError: a device is malformed, repeated or does not exist.
    """
    local = [tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices()]
    local = [s for s in local if s.device_type and s.device_index is not None]
    if devices is None:
        gpus = [s for s in local if s.device_type.upper() == "GPU"]
        chosen = gpus or [s for s in local if s.device_type.upper() == "CPU"]
        return [f"/device:{t}:{i}" for t, i in map(_local_key, chosen)]
    names = normalize_devices(devices)
    local_keys = {_local_key(s) for s in local}
    for k, name in enumerate(names):
        spec = tf.DeviceSpec.from_string(name)
        if _local_key(spec) not in local_keys or spec.job not in (None, "localhost"):
            available = sorted(f"/device:{t}:{i}" for t, i in local_keys)
            raise ValueError(
                f"devices[{k}]={devices[k]!r} does not exist in this process; available "
                f"devices: {available}. For more CPU devices, call "
                "tf.config.set_logical_device_configuration before TensorFlow initialises."
            )
    return names
