"""The public API: every exported name and documented signature, as recorded.

The layout may change behind these names; the names, their signatures and
the constants users rely on may not. A change here is a change of the public
API and must be deliberate (and said in the README).
"""

import importlib
import inspect

import pytest

import tfreduce

# tfreduce.<name> (and each public method of an exported class) -> its
# signature, or the repr of a constant; "property" for properties.
EXPORTS = {
    'ALGORITHMS': "('auto', 'flat', 'hierarchical', 'ring', 'nccl', 'collective')",
    # transport= is new, a keyword with a default: every call that worked works.
    'Cluster': "(cluster_spec, task_type, task_index, timeout=300.0, stall_seconds=None, "
               "transport='grpc')",
    'Cluster.address': '(self, rank=None)',
    'Cluster.agreed': '(self, summed, here)',
    'Cluster.batch_slice': '(self, batch_size, towers_per_worker)',
    'Cluster.describe': '(self, rank)',
    'Cluster.describe_towers': '(self, towers_per_worker)',
    'Cluster.detect_lost_workers': '(self, probe_timeout=5.0)',
    'Cluster.device': "(self, device, where='device')",
    'Cluster.devices': '(self, devices)',
    'Cluster.finish': '(self, session=None, linger=0.5)',
    'Cluster.from_tf_config': "(cls, tf_config=None, timeout=300.0, stall_seconds=None, "
                              "transport='grpc')",
    'Cluster.group_key': '(self, local_devices)',
    'Cluster.is_chief': 'property',
    'Cluster.num_workers': 'property',
    'Cluster.op_timeout': 'property',
    'Cluster.order_after': '(self, tensors)',
    'Cluster.rank': 'property',
    'Cluster.session_config': '(self, config=None)',
    'Cluster.start': '(self)',
    'Cluster.start_server': '(self, config=None)',
    'Cluster.task_name': '(self, rank=None)',
    'Cluster.unreachable_workers': '(self, probe_timeout=5.0)',
    'cluster_from_environment': "(timeout=300.0, stall_seconds=None, transport='auto')",
    'CollectiveKeys': '(first_instance_key=1)',
    'CollectiveKeys.for_call': '(cls, text)',
    'CollectiveKeys.group_key': '(devices)',
    'CollectiveKeys.instance_key': '(self)',
    'Compression': '()',
    'Compressor': '(name, dtype=None)',
    'Compressor.compress': '(self, tensor)',
    'Compressor.compresses': 'property',
    'Compressor.decompress': '(self, tensor, ctx)',
    'Compressor.wire_dtype': '(self, dtype)',
    'CrossDeviceOps': "(algorithm='auto', *, reduction=None, **options)",
    'CrossDeviceOps.batch_reduce_implementation': '(self, reduce_op, value_destination_pairs, options)',
    'CrossDeviceOps.broadcast_implementation': '(self, tensor, destinations)',
    'CrossDeviceOps.reduce_implementation': '(self, reduce_op, per_replica_value, destinations, options)',
    'PowerSGD': '(rank=2, *, min_compression_rate=2.0, seed=0)',
    'PowerSGD.matrix_rank': '(self, shape)',
    'PowerSGD.name': 'property',
    'PowerSGD.payload_elements': '(self, shapes)',
    'ReplicatedTrainer': "(model_fn, loss, optimizer_fn, devices=None, algorithm='auto', average=True, *, bcast_period=0, cluster='auto', accumulate_steps=1, on_nonfinite='raise', reduction=None, powersgd=None, zero_stage=0, micro_batches=None, jit_compile=False, **allreduce_options)",
    'Reduction': "(algorithm: str = 'auto', *, groups: collections.abc.Sequence[collections.abc.Sequence[int]] | None = None, communication: str = 'auto', keys: tfreduce.blocks.collective.CollectiveKeys | None = None, timeout: float | None = None, pack_bytes: int | str | None = 'auto', sparse_as_dense: bool = False, compression: tfreduce.buffers.compression.Compressor | str | None = None, topology: tfreduce.basis.topology.Topology | str | None = None, deterministic: bool = False) -> None",
    'Reduction.check_devices': '(self, devices, cluster=None)',
    'Reduction.describe': '(self)',
    'Reduction.plan': '(self, shapes, devices, dtype=tf.float32, average=True)',
    'Reduction.reduce': '(self, grads, average, later=())',
    'Reduction.stage': 'property',
    'all_gather': "(all_tensors, devices=None, algorithm='auto', *, groups=None, reduction=None, cluster=None, **options)",
    'all_to_all': "(all_tensors, devices=None, splits=None, algorithm='auto', *, groups=None, reduction=None, cluster=None, **options)",
    'broadcast': "(all_tensors, devices=None, root=0, algorithm='auto', *, groups=None, reduction=None, cluster=None, **options)",
    'bus_bandwidth': '(collective, size_bytes, seconds, num_ranks)',
    'reduce': "(all_tensors, devices=None, root=0, average=False, algorithm='auto', *, groups=None, reduction=None, cluster=None, **options)",
    'reduce_scatter': "(all_tensors, devices=None, average=False, algorithm='auto', *, groups=None, reduction=None, cluster=None, **options)",
    'ReplicatedTrainer.broadcast': '(self)',
    'ReplicatedTrainer.check_replicas': '(self)',
    'ReplicatedTrainer.cluster': 'property',
    'ReplicatedTrainer.evaluate': '(self, x, y=None, batch_size=256, sample_weight=None)',
    'ReplicatedTrainer.fault_hook': 'property',
    'ReplicatedTrainer.fit': '(self, x, y=None, *, sample_weight=None, epochs=1, batch_size=32, shuffle=True, seed=0, validation_data=None, logdir=None, checkpoint_dir=None, callbacks=(), verbose=1, profile_steps=None, commit_every=None)',
    'ReplicatedTrainer.is_chief': 'property',
    'ReplicatedTrainer.predict': '(self, x, batch_size=256)',
    'ReplicatedTrainer.restore': '(self, path)',
    'ReplicatedTrainer.save': '(self, path)',
    'ReplicatedTrainer.state_bytes': '(self)',
    'ReplicatedTrainer.state_variables': '(self)',
    'ReplicatedTrainer.step': 'property',
    'ReplicatedTrainer.step_graphs': '(self)',
    'ReplicatedTrainer.tracing_counts': '(self)',
    'ReplicatedTrainer.train_step': '(self, x, y, sample_weight=None)',
    'Topology': "(num_devices, links, memory_bandwidth=inf, launch_cost=0.0, name='custom', compute_lanes=None, cache=None, collective_cost=0.0, copy_cost=0.0, collective_bandwidth=inf, fresh_memory=None)",
    'Topology.cluster': '(cls, preset, nodes, nic_bandwidth=12000000000.0, latency=5e-06)',
    'Topology.device_node': '(k)',
    'Topology.fully_connected': '(cls, num_devices, bandwidth, latency=0.0, **compute)',
    'Topology.preset': '(cls, name)',
    'Topology.route': '(self, src, dst)',
    'Traffic': '(pair_bytes, pair_transfers, unsized_transfers, num_ops, ops_per_device, op_types, longest_hop_chain)',
    'Traffic.as_dict': '(self)',
    'Traffic.devices': 'property',
    'Traffic.received': '(self, device)',
    'Traffic.sent': '(self, device)',
    'Traffic.total_bytes': 'property',
    'WorkerLostError': '(message, lost, error)',
    'allreduce_grads': "(all_grads, devices=None, average=False, algorithm='auto', *, reduction=None, **options)",
    'allreduce_grads_collective': "(all_grads, devices=None, average=False, communication='auto', pack_bytes=65536, sparse_as_dense=False, keys=None, timeout=None, compression=None)",
    'allreduce_grads_flat': '(all_grads, devices=None, average=False, pack_bytes=65536, sparse_as_dense=False, compression=None)',
    'allreduce_grads_hierarchical': '(all_grads, devices=None, average=False, groups=None, pack_bytes=65536, sparse_as_dense=False, compression=None)',
    'allreduce_grads_multiworker': "(all_grads, devices=None, average=False, cluster=None, local_algorithm='auto', local_options=None, pack_bytes=4194304, communication='auto', keys=None, timeout=None, compression=None, *, reduction=None)",
    'allreduce_grads_nccl': '(all_grads, average=False, devices=None, pack_bytes=65536, sparse_as_dense=False, compression=None)',
    'allreduce_grads_ring': '(all_grads, devices=None, average=False, pack_bytes=65536, sparse_as_dense=False, compression=None)',
    'analyze_traffic': '(target, inputs=None)',
    'broadcast_variables': '(all_vars, root=0)',
    'broadcast_variables_multiworker': "(all_vars, cluster, keys=None, timeout=None, communication='auto', root_rank=0)",
    'choose_algorithm': '(devices)',
    'default_groups': '(num_devices)',
    'logical_devices': '(num_devices=None, device_type=None)',
    'max_replica_difference': '(all_vars)',
    'plan_allreduce': '(shapes, devices, topology, dtype=tf.float32, average=True, **options)',
    'predict': '(target, topology, inputs=None, devices_per_task=None, trace=None, ready=None)',
    'predict_step': "(model, batch_per_tower, topology, num_towers=8, reduction='auto', flops_per_s=None, trace=None, compute=None)",
    'merge_grad_list': '(all_grads, all_vars)',
    'split_grad_list': '(grad_list)',
}

# Documented names of submodules: "module.name" -> signature or repr.
MODULE_NAMES = {
    'tfreduce.workers.cluster.parse_tf_config': '(tf_config=None)',
    'tfreduce.workers.cluster.DEFAULT_TIMEOUT': '300.0',
    'tfreduce.doors.multiworker.CROSS_WORKER_PACK_BYTES': '4194304',
    'tfreduce.buffers.packing.DEFAULT_PACK_BYTES': '65536',
    'tfreduce.bench.main': '(argv=None)',
    'tfreduce.bench.parse_bytes': '(text)',
    'tfreduce.bench.format_bytes': '(num)',
    'tfreduce.bench.gradient_shapes': '(model, num_tensors=100, total_bytes=None, dtype_size=4)',
    'tfreduce.launch.main': '(argv=None)',
    'tfreduce.launch.free_ports': "(count, host='127.0.0.1')",
    'tfreduce.launch.tf_config': '(addresses, index)',
    'tfreduce.trainer.ReplicatedTrainer': "(model_fn, loss, optimizer_fn, devices=None, algorithm='auto', average=True, *, bcast_period=0, cluster='auto', accumulate_steps=1, on_nonfinite='raise', reduction=None, powersgd=None, zero_stage=0, micro_batches=None, jit_compile=False, **allreduce_options)",
}


def describe(obj):
    if callable(obj):
        return str(inspect.signature(obj))
    return repr(obj)


def public_methods(name, cls):
    # A class's own members and those it inherits from tfreduce's classes.
    members = {}
    for base in reversed(cls.__mro__):
        if base is cls or base.__module__.startswith("tfreduce"):
            members.update(vars(base))
    out = {}
    for attr, value in sorted(members.items()):
        if attr.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value):
            out[f"{name}.{attr}"] = str(inspect.signature(value))
        elif isinstance(value, property):
            out[f"{name}.{attr}"] = "property"
    return out


def test_the_exported_names_are_the_recorded_ones():
    assert sorted(tfreduce.__all__) == sorted(k for k in EXPORTS if "." not in k)


def test_every_export_has_its_recorded_signature():
    got = {}
    for name in tfreduce.__all__:
        obj = getattr(tfreduce, name)
        got[name] = describe(obj)
        if inspect.isclass(obj):
            got.update(public_methods(name, obj))
    assert got == EXPORTS


@pytest.mark.parametrize("path", sorted(MODULE_NAMES))
def test_documented_module_names(path):
    module, _, name = path.rpartition(".")
    assert describe(getattr(importlib.import_module(module), name)) == MODULE_NAMES[path]
