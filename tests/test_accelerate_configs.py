"""The example accelerate configs (scripts/accelerate_configs/): each parses and passes `accelerate launch`'s
own validation; the FSDP one names our layer classes, and the environment `accelerate launch` derives from
it shards a model layer by layer with FSDP2 (checked on one CPU process); `device_map` keeps layers whole."""

import os
import subprocess
import sys
import textwrap

import pytest
import yaml
from conftest import REPO_ROOT
from model_kinds import AUTO_CLASSES, model

from hf_zformer.modeling import modeling_zformer

CONFIGS = REPO_ROOT / "scripts" / "accelerate_configs"
EXPECTED = {
    "multi_cpu.yaml": "MULTI_GPU",  # the scripts switch to MULTI_CPU/gloo when there is no GPU
    "multi_gpu.yaml": "MULTI_GPU",
    "fsdp.yaml": "FSDP",
    "deepspeed_zero2.yaml": "DEEPSPEED",
    "deepspeed_zero3.yaml": "DEEPSPEED",
}
LAYER_CLASSES = {"ZformerLayer", "ZformerDecoderLayer"}


def launch_args(config_file):
    """What `accelerate launch --config_file <config_file> train.py` makes of the file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    return _validate_launch_command(args)[0]


def test_the_expected_configs_are_there():
    assert {path.name for path in CONFIGS.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_parses_and_accelerate_launch_accepts_it(name):
    config = yaml.safe_load((CONFIGS / name).read_text())
    assert config["distributed_type"] == EXPECTED[name]
    args = launch_args(CONFIGS / name)
    assert args.num_processes == config["num_processes"]
    assert args.use_fsdp == (config["distributed_type"] == "FSDP")
    assert args.use_deepspeed == (config["distributed_type"] == "DEEPSPEED")
    if args.use_deepspeed:
        stage = config["deepspeed_config"]["zero_stage"]
        assert name == f"deepspeed_zero{stage}.yaml"
        # ZeRO-3 holds no full weight anywhere: save_pretrained needs them gathered
        assert stage != 3 or config["deepspeed_config"]["zero3_save_16bit_model"] is True


def test_fsdp_config_wraps_by_layer_class_and_each_model_names_exactly_its_layer_classes():
    """fsdp.yaml wraps the classes a model names in `_no_split_modules` (accelerate's default); each model
    names exactly the layer classes it contains, which accelerate requires of every name."""
    fsdp = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())["fsdp_config"]
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp
    for name in LAYER_CLASSES:
        assert issubclass(getattr(modeling_zformer, name), modeling_zformer.GradientCheckpointingLayer), name
    for kind in AUTO_CLASSES:
        net = model(kind, "zformer")
        present = {type(module).__name__ for module in net.modules()} & LAYER_CLASSES
        assert set(net._no_split_modules) == present, (kind, net._no_split_modules, present)
        assert present == {"classification": {"ZformerLayer"}, "masked": {"ZformerLayer"}, "causal": {
            "ZformerDecoderLayer"}, "seq2seq": LAYER_CLASSES}[kind]


@pytest.mark.parametrize("kind", ["classification", "seq2seq", "causal"])
def test_device_map_keeps_every_layer_on_one_device(kind):
    """accelerate's device map (from_pretrained(device_map=...)) over three devices: no layer split."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    net = model(kind, "zformer")
    size = compute_module_sizes(net)[""]
    device_map = infer_auto_device_map(net, max_memory={0: size // 3, 1: size // 3, "cpu": 10 * size},
                                       no_split_module_classes=net._no_split_modules)
    assert len(set(device_map.values())) > 1, device_map  # really split across devices
    layers = [name for name, module in net.named_modules() if type(module).__name__ in LAYER_CLASSES]
    for key in device_map:
        assert not any(key.startswith(layer + ".") for layer in layers), f"{key} splits a layer: {device_map}"


WRAP_WITH_ACCELERATE_PLUGIN = """
import os, sys
import torch, torch.distributed as dist
sys.path.insert(0, "tests")
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from torch.distributed.fsdp import FSDPModule, fully_shard
from model_kinds import batch, model

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
for kind in ("classification", "masked", "seq2seq", "causal"):
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables accelerate launch sets
    assert plugin.fsdp_version == 2, plugin.fsdp_version
    net = model(kind, "zformer")
    plugin.set_auto_wrap_policy(net)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, net)
    wrapped = [name for name, module in net.named_modules() if policy(module)]
    layers = [n for n, m in net.named_modules() if type(m).__name__ in ("ZformerLayer", "ZformerDecoderLayer")]
    for name, module in net.named_modules():
        if policy(module):
            fully_shard(module, reshard_after_forward=plugin.reshard_after_forward)
    fully_shard(net)
    assert wrapped == layers and len(layers) == (4 if kind == "seq2seq" else 2), (wrapped, layers)
    assert all(isinstance(m, FSDPModule) for n, m in net.named_modules() if n in layers)
    net(**batch(kind)).loss.backward()
dist.destroy_process_group()
print("wrapped")
"""


def test_fsdp_config_shards_a_model_per_layer_on_cpu(tmp_path):
    """The FSDP_* environment `accelerate launch --config_file fsdp.yaml` gives each process, turned into
    accelerate's FSDP plugin and its FSDP2 wrap policy: for every model kind, each layer becomes its own FSDP
    unit, and a training step runs (one CPU process; accelerate itself applies the plugin only on GPUs)."""
    from accelerate.utils.launch import prepare_multi_gpu_env

    launch_env = prepare_multi_gpu_env(launch_args(CONFIGS / "fsdp.yaml"))
    env = {**os.environ, **{k: v for k, v in launch_env.items() if k.startswith("FSDP_")}, "OMP_NUM_THREADS": "1"}
    assert env["FSDP_VERSION"] == "2" and env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(WRAP_WITH_ACCELERATE_PLUGIN), str(tmp_path / "store")],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "wrapped" in result.stdout, result.stdout + result.stderr[-5000:]
