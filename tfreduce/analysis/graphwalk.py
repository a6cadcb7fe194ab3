"""The walk over a built graph that traffic analysis and the cost model share.

Both read a built reduction without running it: its ops (a whole graph, or
the ops its outputs depend on, walking back to given inputs), the tensors
nested in a K x N result, and each tensor's static size in bytes.
"""

import tensorflow as tf

__all__ = ["as_graph", "tensors", "walk_back", "static_bytes"]


def as_graph(target):
    """The graph ``target`` is (a tf.Graph, a concrete function), or None for outputs."""
    if isinstance(target, tf.Graph):
        return target
    if isinstance(target, (list, tuple, tf.Tensor, tf.IndexedSlices, tf.Operation)):
        return None
    graph = getattr(target, "graph", None)  # a ConcreteFunction
    return graph if isinstance(graph, tf.Graph) else None


def tensors(nested, what):
    """The graph tensors in ``nested`` (lists of tensors, IndexedSlices, None), in order.

    Raises:
      TypeError: an item that is none of these; ``what`` names the argument.
    """
    out = []
    stack = [nested]
    while stack:
        item = stack.pop()
        if item is None:
            continue
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, tf.IndexedSlices):
            out.extend(t for t in (item.values, item.indices, item.dense_shape)
                       if t is not None)
        elif isinstance(item, tf.Tensor) and hasattr(item, "op"):
            out.append(item)
        else:
            raise TypeError(
                f"{what} must hold graph tensors, tf.IndexedSlices or None (nested in "
                f"lists), got {type(item).__name__}; build the reduction in a "
                f"tf.function or a tf.Graph")
    return out


def walk_back(start, stop):
    """The ops that ``start`` depends on (data and control inputs), stopping at ``stop``."""
    found = []
    seen = set()
    stack = [op for op in start if op not in stop]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        found.append(op)
        for t in op.inputs:
            if t.op not in stop and t.op not in seen:
                stack.append(t.op)
        for dep in op.control_inputs:
            if dep not in stop and dep not in seen:
                stack.append(dep)
    return found


def static_bytes(tensor):
    """int bytes of a tensor of fully defined shape, or None."""
    shape = tensor.shape
    if not shape.is_fully_defined():
        return None
    return shape.num_elements() * tensor.dtype.size
