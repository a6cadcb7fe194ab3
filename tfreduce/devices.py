"""Device names and this process's devices.

Device strings are normalised on entry (``"/gpu:1"``, ``"GPU:1"`` and
``"/device:GPU:1"`` all become ``"/device:GPU:1"``) so that placements and
duplicates compare equal.

Without GPUs, K logical CPU devices stand in for K GPUs (the example, the
benchmark and the tests all run that way). They can only be made before
TensorFlow initialises its runtime, so ``logical_devices`` is called first
thing in a program; ``tower_devices`` then checks the devices a trainer is
given against what this process has.
"""

import tensorflow as tf

__all__ = ["normalize_device", "normalize_devices", "is_gpu", "logical_devices",
           "tower_devices", "DEFAULT_CPU_DEVICES"]

#: K when no GPU exists and no count is given: two towers, the smallest
#: data-parallel run.
DEFAULT_CPU_DEVICES = 2


def normalize_device(device, where="device"):
    """Returns the canonical form of one device string.

    ``"/gpu:1"``, ``"GPU:1"`` and ``"/device:GPU:1"`` all become
    ``"/device:GPU:1"``, so that duplicates and placements compare equal.

    Args:
      device: str, a TensorFlow device string naming one device.
      where: str, how to name this device in an error message.

    Returns:
      str, ``tf.DeviceSpec.from_string(device).to_string()``.

    Raises:
      TypeError: if ``device`` is not a string.
      ValueError: if it cannot be parsed, or does not name one device (no
        device type or index, or a wildcard index).
    """
    if isinstance(device, tf.DeviceSpec):
        device = device.to_string()
    if not isinstance(device, str):
        raise TypeError(
            f"{where} must be a device string such as '/gpu:0', "
            f"got {type(device).__name__} {device!r}")
    try:
        spec = tf.DeviceSpec.from_string(device)
    except ValueError as e:
        raise ValueError(
            f"{where} {device!r} is not a valid device string "
            f"(expected e.g. '/gpu:0' or '/device:CPU:1'): {e}") from None
    if spec.device_type is None or spec.device_index is None:
        raise ValueError(
            f"{where} {device!r} does not name one device: give a type and an "
            f"index, e.g. '/gpu:0'")
    return spec.to_string()


def normalize_devices(devices, num_towers=None):
    """Normalises a list of K distinct device strings.

    Args:
      devices: sequence of K device strings.
      num_towers: int or None; if given, the K that ``devices`` must have.

    Returns:
      list[str] of K canonical device strings.

    Raises:
      TypeError: if ``devices`` is not a list or tuple of strings.
      ValueError: if it is empty, its length differs from ``num_towers``, a
        string is malformed, or two entries name the same device.
    """
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple)):
        raise TypeError(
            f"devices must be a list of device strings, one per tower, "
            f"got {type(devices).__name__} {devices!r}")
    if not devices:
        raise ValueError("devices is empty: give one device per tower")
    if num_towers is not None and len(devices) != num_towers:
        raise ValueError(
            f"all_grads has {num_towers} towers but {len(devices)} devices were "
            f"given ({list(devices)!r}): give exactly one device per tower")
    out = [normalize_device(d, where=f"devices[{k}]") for k, d in enumerate(devices)]
    seen = {}
    for k, d in enumerate(out):
        if d in seen:
            raise ValueError(
                f"devices[{seen[d]}] ({devices[seen[d]]!r}) and devices[{k}] "
                f"({devices[k]!r}) are the same device {d!r}: each tower needs "
                f"its own device")
        seen[d] = k
    return out


def is_gpu(device):
    """True if the canonical device string names a GPU."""
    return (tf.DeviceSpec.from_string(device).device_type or "").upper() == "GPU"


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
