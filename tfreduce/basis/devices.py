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

import functools

import tensorflow as tf

__all__ = ["normalize_device", "normalize_devices", "is_gpu", "logical_devices",
           "tower_devices", "check_devices_exist", "DEFAULT_CPU_DEVICES", "canonical_or_empty",
           "local_name", "host_device", "topology_index"]

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


def canonical_or_empty(device):
    """An op's device string in canonical form; "" (an unplaced op) stays ""."""
    if not device:
        return ""
    return tf.DeviceSpec.from_string(device).to_string()


def local_name(device):
    """"/job:worker/replica:0/task:1/device:CPU:0" -> "/device:CPU:0"."""
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def host_device(device):
    """The CPU of a device's task: "/job:w/task:1/device:GPU:1" -> ".../device:CPU:0"."""
    return tf.DeviceSpec.from_string(device).replace(device_type="CPU", device_index=0).to_string()


def topology_index(device, devices_per_task=None):
    """The topology index of a device name: "/gpu:k" (or CPU:k) is k.

    With ``devices_per_task`` G, "/job:worker/task:w/device:GPU:k" is w*G + k.
    Returns None for an op without a device.
    """
    if not device:
        return None
    spec = tf.DeviceSpec.from_string(device)
    index = spec.device_index or 0
    if devices_per_task and spec.task is not None:
        index += spec.task * devices_per_task
    return index


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
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is None or len(configured) < count:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
            configured = [None] * count
        except RuntimeError:
            pass  # TensorFlow is already initialised: what exists is checked below.
    if configured is not None and len(configured) >= count:
        # Named without listing them: listing would start TensorFlow's runtime,
        # and a cluster's server is best started before that (Cluster.start).
        return [f"/device:CPU:{i}" for i in range(count)]
    existing = tf.config.list_logical_devices("CPU")
    if len(existing) < count:
        raise ValueError(
            f"only {len(existing)} logical CPU devices exist and TensorFlow is already "
            f"initialised, so no more can be made; configure more before TensorFlow "
            f"starts or ask for fewer")
    return [f"/device:CPU:{tf.DeviceSpec.from_string(d.name).device_index}"
            for d in existing[:count]]


@functools.lru_cache(maxsize=1)
def _local_devices():
    """This process's logical devices as DeviceSpecs with a type and an index.

    Listing them starts TensorFlow's runtime, after which they cannot change,
    so the list is made once (an eager all-reduce checks its devices per call).
    """
    local = [tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices()]
    return tuple(s for s in local if s.device_type and s.device_index is not None)


def check_devices_exist(names, given=None):
    """Checks that canonical device names name devices of this process.

    A name with a job other than "localhost" (a cluster's device, e.g.
    ``/job:worker/replica:0/task:1/device:CPU:0``) is not checked: whether
    another task has it is not known here.

    Args:
      names: list of K canonical device strings.
      given: list of K strings, the devices as the caller gave them (for the
        message); None to use ``names``.

    Raises:
      ValueError: ``devices[k]`` does not exist in this process; the message
        lists the devices that do and how to make K logical CPU devices.
    """
    given = names if given is None else given
    local_keys = {_local_key(s) for s in _local_devices()}
    for k, name in enumerate(names):
        spec = tf.DeviceSpec.from_string(name)
        if spec.job in (None, "localhost") and _local_key(spec) not in local_keys:
            available = sorted(f"/device:{t}:{i}" for t, i in local_keys)
            raise ValueError(
                f"devices[{k}]={given[k]!r} does not exist in this process; available "
                f"devices: {available}. For K logical CPU devices, call "
                f"tfreduce.logical_devices(K) before TensorFlow initialises (it calls "
                f"tf.config.set_logical_device_configuration).")


def tower_devices(devices):
    """Checks device names against this process's logical devices.

    Args:
      devices: None, or a non-empty list of device strings such as "/gpu:0".

    Returns:
      list[str], K canonical names ("/device:GPU:0"), in the given order;
      for None every GPU, or every CPU when there is no GPU.

    Raises:
      TypeError: devices is not a list of strings.
      ValueError: a device is malformed, repeated, names a job other than
        "localhost", or does not exist.
    """
    if devices is None:
        local = _local_devices()
        gpus = [s for s in local if s.device_type.upper() == "GPU"]
        chosen = gpus or [s for s in local if s.device_type.upper() == "CPU"]
        return [f"/device:{t}:{i}" for t, i in map(_local_key, chosen)]
    names = normalize_devices(devices)
    for k, name in enumerate(names):
        job = tf.DeviceSpec.from_string(name).job
        if job not in (None, "localhost"):
            raise ValueError(
                f"devices[{k}]={devices[k]!r} names job {job!r}: give this process's "
                f"devices without a job (a cluster names them itself)")
    check_devices_exist(names, devices)
    return names
