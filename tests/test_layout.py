"""The layout: one validation per call, layers that import downwards, small modules."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import tfreduce
from helpers import GPU_DEVICES, placeholders
from tfreduce.basis import contract
from tfreduce.workers.cluster import Cluster

PACKAGE = pathlib.Path(tfreduce.__file__).parent

# Each module's layer (docs/architecture.md): a module imports only modules of a
# smaller layer, or of its own layer where the pair is listed below.
LAYERS = {
    "tf_config": 0, "ports": 0, "startup": 0, "choices": 0, "topology": 0, "watchdog": 0, "stragglers": 0,
    "progress": 0, "collective_rules": 0, "heartbeats": 0, "agent": 0, "generations": 0, "membership": 0,
    "devices": 1, "elastic_launch": 1, "mpi_transport": 1,
    "contract": 2, "shards": 2, "kerases": 2,
    "packing": 3, "compression": 3, "graphwalk": 3,
    "primitives": 4, "collective": 4, "traffic": 4, "stage": 4, "timeline": 4,
    "frame": 5, "replicated": 5, "hierarchical": 5, "ring": 5, "nccl_ops": 5, "tree": 5,
    "registry": 5, "costmodel": 5, "profiler": 5, "hostprobe": 5, "planner": 5, "powersgd": 5,
    "failures": 5, "cluster": 5, "localcluster": 5, "environment": 5, "crossworker": 5, "consistency": 5,
    "rounds": 5,
    "reduction": 6, "collective_build": 6,
    "allreduce": 7, "multiworker": 7, "collectives": 7, "stepmodel": 7,
    "trainer": 8, "distribute": 8, "tensorflow": 8,
    "launch": 9, "preload": 9, "bench": 9,
}
# Same-layer imports that are part of the design: the stage contract uses the
# primitives' one scaling; the commands' choices name the collectives' rules;
# the planner costs the registry's stages, run in the frame, with the cost
# model, which calls the host probe, which times the collective algorithm's
# stage; the cluster uses the failure probes and counts its rounds; the watchdog, its
# heartbeats, the launcher's agent, the straggler rule and this process's
# progress, which keeps the straggler rule's window of step times;
# the cross-worker stage sums in the deterministic tree; an mpirun's TF_CONFIG
# takes free ports; the environment's cluster is a Cluster.
SAME_LAYER = {
    ("stage", "primitives"), ("shards", "contract"),
    ("cluster", "failures"), ("cluster", "rounds"), ("costmodel", "hostprobe"),
    ("hostprobe", "frame"), ("hostprobe", "nccl_ops"), ("planner", "hostprobe"),
    ("planner", "costmodel"), ("planner", "registry"), ("planner", "frame"),
    ("watchdog", "stragglers"), ("watchdog", "progress"), ("progress", "stragglers"),
    ("watchdog", "heartbeats"), ("watchdog", "agent"),
    ("launch", "preload"), ("choices", "collective_rules"), ("crossworker", "tree"),
    ("tf_config", "ports"), ("environment", "cluster"),
}


# The packages named for the layers, from the bottom: each holds the modules
# of one or a few adjacent layers, and a module imports from its own
# package or one below. trainer/, tensorflow/ and bench/ are one unit each.
PACKAGE_ORDER = ["basis", "buffers", "blocks", "algorithms", "analysis", "workers", "choice",
                 "doors", "trainer", "tensorflow", "bench"]
LAYER_PACKAGES = PACKAGE_ORDER[:8]


def sources():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def unit(parts):
    """The module a layer is given to, from a module path's parts after "tfreduce"."""
    if parts[0] in LAYER_PACKAGES and len(parts) > 1:
        return parts[1]
    return parts[0]


def top_module(path):
    return unit(path.relative_to(PACKAGE).with_suffix("").parts)


def package_of(path):
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else None


def imported_paths(path):
    """The module paths (parts after "tfreduce") a file imports."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                "tfreduce."):
            parts = tuple(node.module.split(".")[1:])
            if len(parts) == 1 and parts[0] in LAYER_PACKAGES:  # from tfreduce.basis import x
                yield from ((parts[0], alias.name) for alias in node.names)
            else:
                yield parts
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tfreduce."):
                    yield tuple(alias.name.split(".")[1:])


def tfreduce_imports(path):
    return (unit(parts) for parts in imported_paths(path))


def test_every_module_has_a_layer():
    assert {top_module(p) for p in sources()} - {"__init__"} == set(LAYERS)


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    module = top_module(path)
    if module == "__init__":
        return
    for imported in tfreduce_imports(path):
        if imported == module:
            continue  # inside a package (trainer/, bench/)
        assert (LAYERS[imported] < LAYERS[module]
                or (module, imported) in SAME_LAYER), f"{module} imports {imported}"


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_packages_import_down_their_order(path):
    here = package_of(path)
    for parts in imported_paths(path):
        there = parts[0] if parts[0] in PACKAGE_ORDER else None
        if here in PACKAGE_ORDER and there is not None:
            assert PACKAGE_ORDER.index(there) <= PACKAGE_ORDER.index(here), (
                f"{path.relative_to(PACKAGE)} imports tfreduce.{'.'.join(parts)}")


def test_the_top_level_holds_the_packages_and_the_commands():
    top = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert top == sorted(PACKAGE_ORDER + ["__init__.py", "launch.py", "preload.py"])
    for package in LAYER_PACKAGES:  # a docstring only: importing a package imports no module
        body = ast.parse((PACKAGE / package / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0].value, ast.Constant), package


@pytest.mark.slow
def test_every_old_module_path_imports_the_moved_module():
    # Users import tfreduce.hierarchical, tfreduce.replicated, tfreduce.nccl_ops
    # (tensorpack style): every module path from before the move still works,
    # as the same module object, without TensorFlow where the module needs none.
    code = (
        "import sys, importlib, tfreduce\n"
        "import tfreduce.tf_config, tfreduce.watchdog\n"
        "assert 'tensorflow' not in sys.modules\n"
        "from tfreduce.hierarchical import HierarchicalStage\n"
        "for old, package in tfreduce.MOVED.items():\n"
        "    module = importlib.import_module('tfreduce.' + old)\n"
        "    new = sys.modules[f'tfreduce.{package}.{old}']\n"
        "    assert module is new is getattr(tfreduce, old), old\n"
        "    assert module.__name__ == f'tfreduce.{package}.{old}'\n"
        "assert HierarchicalStage is sys.modules['tfreduce.algorithms.hierarchical']"
        ".HierarchicalStage\n"
        "print(len(tfreduce.MOVED))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # Every old name is a module of its package (modules added since have no old path).
    packaged = {p.stem for p in sources() if package_of(p) in LAYER_PACKAGES} | {"models"}
    assert set(tfreduce.MOVED) <= packaged and done.stdout.split()[-1] == "43"
    with pytest.raises(ModuleNotFoundError, match="No module named 'tfreduce.nonesuch'"):
        __import__("tfreduce.nonesuch")


def test_tf_config_and_launcher_need_no_tensorflow():
    code = ("import sys, tfreduce.basis.tf_config, tfreduce.launch; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    help_run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tfreduce.launch", "--help"],
        capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0 and "--workers" in help_run.stdout
    assert "tensorflow" not in help_run.stderr  # -X importtime lists every import


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_small(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 450, f"{path.name}: over 450 lines"
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name == "parse_args":
            continue  # argparse set-up
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring does not count
        lines = body[-1].end_lineno - body[0].lineno + 1 if body else 0
        assert lines <= 60, f"{path.name}: {node.name} has {lines} lines of code"


@pytest.fixture
def count_validations(monkeypatch):
    """Counts the K x N validations (each builds one contract.Gradients)."""
    calls = []
    init = contract.Gradients.__init__

    def counting(self, *args, **kwargs):
        calls.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(contract.Gradients, "__init__", counting)
    return calls


@pytest.mark.parametrize("call", [
    lambda grads, devices: tfreduce.allreduce_grads(grads, devices),  # "auto"
    lambda grads, devices: tfreduce.allreduce_grads(grads, devices, algorithm="hierarchical"),
    lambda grads, devices: tfreduce.allreduce_grads_ring(grads, devices),
    lambda grads, devices: tfreduce.allreduce_grads_multiworker(
        grads, devices, cluster=Cluster({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
                                        "worker", 1), local_algorithm="auto"),
    lambda grads, devices: tfreduce.allreduce_grads_multiworker(
        grads, devices, cluster=Cluster({"worker": ["127.0.0.1:2222"]}, "worker", 0),
        local_algorithm="collective"),
], ids=["auto", "hierarchical", "ring", "multiworker-auto", "multiworker-collective"])
def test_one_call_validates_its_input_once(call, count_validations):
    devices = GPU_DEVICES[:4]
    with tf.Graph().as_default():
        grads = placeholders(devices, [(3,), (2, 2), (5,)])
        out = call(grads, devices)
    assert len(out) == 4 and all(len(row) == 3 for row in out)
    assert len(count_validations) == 1


def test_no_module_imports_another_modules_private_names():
    found = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfreduce"):
                found += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_")]
    assert not found, f"private names imported from another module: {found}"


def test_the_trainer_has_one_code_path_for_one_process_and_a_cluster():
    # One process is a LocalCluster: no trainer module asks whether there is a cluster.
    branches = [f"{path.name}:{number}" for path in sorted((PACKAGE / "trainer").glob("*.py"))
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if "cluster is None" in line or "cluster is not None" in line]
    assert not branches, branches


def test_the_zero_stage_is_asked_only_by_the_sharding_objects():
    # The towers hold a sharding (ReplicatedState or ZeroState): the step,
    # the broadcast and the checkpoint call it instead of testing the stage.
    asks = re.compile(r"zero is (not )?None|(?<!trainer)\.zero\b|if [\w.]*zero_stage\b|zero_stage [=!]=|"
                      r"stage [=!]= [0-2]")
    found = [f"{path.name}:{number}: {line.strip()}"
             for path in sorted((PACKAGE / "trainer").glob("*.py"))
             if path.name not in ("sharding.py", "zero.py")
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if asks.search(line)]
    assert not found, found


def test_the_step_graph_builders_take_at_most_five_parameters():
    # What every step reads (towers, options, state, counter) is held by
    # StepGraph and reached through it, not passed along.
    builders = ["step.py", "sharding.py", "zero.py", "statistics.py", "update.py"]
    found = []
    for name in builders:
        for node in ast.walk(ast.parse((PACKAGE / "trainer" / name).read_text())):
            if isinstance(node, ast.FunctionDef):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                names = [a.arg for a in args if a.arg not in ("self", "cls")]
                if len(names) > 5:
                    found.append(f"{name}: {node.name}({', '.join(names)})")
    assert not found, found


def private_members(paths):
    """{name: class}: the private methods and attributes (self._x = ...) of the files' classes."""
    found = {}
    for path in paths:
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef):
                    name = node.name
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    name = node.attr
                else:
                    continue
                if name.startswith("_") and not name.startswith("__"):
                    found[name] = cls.name
    return found


def test_no_test_reads_a_private_member_of_the_trainer():
    # Tests see inside a trainer through its public seams (step_graphs,
    # state_variables, fault_hook, a checkpoint): a test that reads
    # trainer._x breaks when the state moves, and tests nothing a user sees.
    private = private_members(sorted((PACKAGE / "trainer").glob("*.py")))
    assert private["_built_steps"] == "ReplicatedTrainer" and private["_slots"] == "OptimizerState"
    tests = pathlib.Path(__file__).parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                found.append(f"{path.relative_to(tests)}:{node.lineno}: {ast.unparse(node)} "
                             f"({private[node.attr]}'s)")
    assert not found, found


def test_the_trainer_options_reach_few_modules():
    # The communication choice is one value: the trainer's settings need
    # Reduction, PowerSGD and the update's checks, not the layers below.
    modules = set(tfreduce_imports(PACKAGE / "trainer" / "options.py"))
    assert len(modules) <= 3, modules


def test_the_architecture_page_gives_every_module_its_layer():
    # docs/architecture.md's table: "| layer | `module.py`, ... | what it owns |".
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    documented = {}
    for layer, modules in re.findall(r"^\| (\d+) \| ([^|]+) \|", page, re.MULTILINE):
        for package, name in re.findall(r"`(?:([a-z]+)/)?([a-z_]+)(?:\.py|/)`", modules):
            documented[name] = int(layer)
            if package:  # the module is where the page says
                assert (PACKAGE / package / f"{name}.py").exists(), (package, name)
            elif name not in PACKAGE_ORDER:
                assert (PACKAGE / f"{name}.py").exists(), name
    assert documented == LAYERS


def test_the_registered_algorithms_sit_below_the_registry():
    # registry.STAGES imports the classes choices.STAGE_CLASSES names.
    from tfreduce.basis.choices import STAGE_CLASSES
    for name, path in STAGE_CLASSES.items():
        module = unit(tuple(path.split(":")[0].split(".")[1:]))
        assert LAYERS[module] <= LAYERS["registry"], (name, path)
