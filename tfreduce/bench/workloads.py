"""What the allreduce mode reduces: a Keras model's gradient shapes, or synthetic ones."""

import numpy as np

__all__ = ["gradient_shapes", "keras_application"]


def keras_application(name):
    """The ``keras.applications`` builder of a model name, in any case.

    Args:
      name: str, e.g. "resnet50", "ResNet50" or "mobilenet_v2".

    Returns:
      callable, the builder (``keras.applications.ResNet50``); nothing is built.

    Raises:
      ValueError: no application of that name; the message lists them.
    """
    import keras  # Only the model modes need Keras; it is slow to import.
    builders = {attr.lower(): getattr(keras.applications, attr)
                for attr in dir(keras.applications)
                if attr[:1].isupper() and callable(getattr(keras.applications, attr))}
    key = name.lower().replace("_", "")
    if key not in builders:
        raise ValueError(f"unknown Keras application {name!r}; choose 'synthetic' or one "
                         f"of {sorted(builders)}")
    return builders[key]


def gradient_shapes(model, num_tensors=100, total_bytes=None, dtype_size=4):
    """The gradient shapes to reduce: a Keras model's trainable tensors, or synthetic.

    Args:
      model: "synthetic", or the name of a ``keras.applications`` model in
        any case ("resnet50", "MobileNetV2"); it is built with
        ``weights=None`` (nothing is downloaded) and its trainable weights'
        shapes are returned (ResNet50: 214 tensors, 25,583,592 elements).
      num_tensors: int N for "synthetic".
      total_bytes: int or None. For "synthetic", the total size of the N
        equal tensors (default N * 4 KiB). For a model, every tensor is
        rescaled to about ``size * total_bytes / model_bytes`` (at least one
        element) and flattened to 1-D, so the same N tensors keep their
        relative sizes at another total.
      dtype_size: int, bytes per element.

    Returns:
      list of N tuples of ints.

    Raises:
      ValueError: unknown model, or num_tensors / total_bytes < 1.
    """
    if model == "synthetic":
        if num_tensors < 1:
            raise ValueError(f"--num-tensors must be >= 1, got {num_tensors}")
        total = (num_tensors * 4096) if total_bytes is None else total_bytes
        each = max(1, total // (num_tensors * dtype_size))
        return [(each,)] * num_tensors
    net = keras_application(model)(weights=None)
    shapes = [tuple(int(d) for d in w.shape) for w in net.trainable_weights]
    del net
    if total_bytes is None:
        return shapes
    if total_bytes < 1:
        raise ValueError(f"--total-bytes must be >= 1, got {total_bytes}")
    scale = total_bytes / (sum(int(np.prod(s)) for s in shapes) * dtype_size)
    return [(max(1, int(round(int(np.prod(s)) * scale))),) for s in shapes]
