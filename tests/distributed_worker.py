"""Sharded training checks in CPU processes (gloo), started by torchrun from tests/test_distributed.py:

    torchrun --nproc_per_node 2 tests/distributed_worker.py --workdir DIR --cases classification:zformer,...
        --modes fsdp2,fsdp1

For each model kind x attention type and each sharding mode (FSDP2 `fully_shard` per layer and at the
root; FSDP1 `FullyShardedDataParallel` auto-wrapping our layer classes):
- one AdamW step on each process's rows of a batch equals the same step taken in one process on
  the mean of those rows' losses: the loss, every gathered gradient and every gathered parameter
  to 1e-5;
- a sharded state dict (torch.distributed.checkpoint) and a full one (gathered, saved with
  save_pretrained) load back into fresh models, sharded and plain, with identical outputs;
- tied embeddings are one parameter before and after, and equal in every state dict.
Rank 0 appends one JSON line per passed (kind, attention, mode) to DIR/report.jsonl; any failure raises.
"""

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_kinds import AUTO_CLASSES, batch, model, rows  # noqa: E402

from hf_zformer.modeling.modeling_zformer import ZformerDecoderLayer, ZformerLayer  # noqa: E402

LAYER_CLASSES = (ZformerLayer, ZformerDecoderLayer)
ROWS_PER_RANK = 2
LR = 1e-2  # large enough that a wrong gradient moves a parameter by more than the tolerance


def shard(net, mode: str):
    """`net` sharded over all processes: FSDP2 (each layer, then the root) or FSDP1 (auto-wrap of our
    layer classes). Returns the module to call (FSDP2 shards in place)."""
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for module in net.modules():
            if isinstance(module, LAYER_CLASSES):
                fully_shard(module)
        return fully_shard(net)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(LAYER_CLASSES))
    return FullyShardedDataParallel(net, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))


def inner(net):
    """The model under an FSDP1 wrapper (FSDP2 leaves the class as it was)."""
    return getattr(net, "module", net)


def check_tied(net, where: str):
    model_ = inner(net)
    if model_.config.tie_word_embeddings and model_.get_output_embeddings() is not None:
        assert model_.get_output_embeddings().weight is model_.get_input_embeddings().weight, f"{where}: untied"


def check_tied_state(state: dict, net, where: str):
    for target, source in (getattr(inner(net), "_tied_weights_keys", None) or {}).items():
        if target in state and source in state:
            torch.testing.assert_close(state[target], state[source], rtol=0, atol=0, msg=f"{where}: {target}")


def outputs(net, inputs) -> torch.Tensor:
    net.eval()
    with torch.no_grad():
        logits = net(**inputs).logits
    net.train()
    return logits


def reference_step(kind, attention, full_batch, world):
    """The step in one process: the mean of each rank's loss, one backward, one AdamW step."""
    net = model(kind, attention).train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    losses = [net(**rows(full_batch, r * ROWS_PER_RANK, (r + 1) * ROWS_PER_RANK)).loss for r in range(world)]
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in net.named_parameters()}
    optimizer.step()
    return loss.item(), grads, {name: t.detach().clone() for name, t in net.state_dict().items()}


def full_gradients(net, mode: str) -> dict:
    """Every parameter's whole gradient (sharded across processes during training), by its name in the
    unwrapped model."""
    if mode == "fsdp2":
        return {name: p.grad.full_tensor() for name, p in net.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(net, with_grads=True):
        return {name.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for name, p in net.named_parameters()}


def check(kind, attention, mode, workdir: Path):
    rank, world = dist.get_rank(), dist.get_world_size()
    full_batch = batch(kind, rows=ROWS_PER_RANK * world)
    local = rows(full_batch, rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    where = f"{kind}/{attention}/{mode}"

    # One training step, sharded and in one process.
    expected_loss, expected_grads, expected = reference_step(kind, attention, full_batch, world)
    net = shard(model(kind, attention).train(), mode)
    check_tied(net, where + " after wrapping")
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    loss = net(**local).loss
    loss.backward()
    grads = full_gradients(net, mode)  # AdamW's first step is nearly sign(gradient): check the gradients too
    assert set(grads) == set(expected_grads), (where, set(grads) ^ set(expected_grads))
    for name, value in expected_grads.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} grad {name}: {m}")
    optimizer.step()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    assert abs(mean_loss.item() / world - expected_loss) <= 1e-6 * max(1.0, abs(expected_loss)), (
        where, mean_loss.item() / world, expected_loss)
    check_tied(net, where + " after a step")
    gathered = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    assert set(expected) <= set(gathered), (where, set(expected) - set(gathered))
    for name, value in expected.items():
        torch.testing.assert_close(gathered[name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} {name}: {m}")
    check_tied_state(gathered, net, where)
    trained_outputs = outputs(net, local)

    # Sharded state dict (every process writes its shards) into a fresh sharded model.
    sharded_dir = workdir / f"{kind}-{attention}-{mode}-sharded"
    dcp.save({"model": get_model_state_dict(net)}, checkpoint_id=str(sharded_dir))
    fresh = shard(model(kind, attention, seed=1).train(), mode)
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=str(sharded_dir))
    set_model_state_dict(fresh, state["model"])
    check_tied(fresh, where + " sharded load")
    torch.testing.assert_close(outputs(fresh, local), trained_outputs, rtol=0, atol=0, msg=f"{where}: sharded load")

    # Full state dict: gathered on rank 0, saved with save_pretrained, loaded plain and sharded.
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    full_dir = workdir / f"{kind}-{attention}-{mode}-full"
    if rank == 0:
        check_tied_state(full, net, where + " full state dict")
        plain = model(kind, attention, seed=2)
        plain.load_state_dict(full)
        plain.save_pretrained(full_dir)
    dist.barrier()
    loaded = AUTO_CLASSES[kind].from_pretrained(full_dir)
    check_tied(loaded, where + " from_pretrained")
    torch.testing.assert_close(outputs(loaded, local), trained_outputs, rtol=0, atol=1e-6,
                               msg=f"{where}: from_pretrained of the full state dict")
    fresh = shard(model(kind, attention, seed=3).train(), mode)
    set_model_state_dict(fresh, full if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    check_tied(fresh, where + " full load")
    torch.testing.assert_close(outputs(fresh, local), trained_outputs, rtol=0, atol=0, msg=f"{where}: full load")
    if rank == 0:
        with open(workdir / "report.jsonl", "a") as report:
            report.write(json.dumps({"kind": kind, "attention": attention, "mode": mode, "loss": expected_loss}) + "\n")


def check_ddp_checkpointing(kind, attention, workdir: Path):
    """DDP with gradient checkpointing (non-reentrant recomputation of every layer) and the tied-embedding
    lookups: each process's step on its rows gives the one-process step's gradients (DDP averages them),
    loss and parameters."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    full_batch = batch(kind, rows=ROWS_PER_RANK * world)
    local = rows(full_batch, rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    where = f"{kind}/{attention}/ddp-gc"
    expected_loss, expected_grads, expected = reference_step(kind, attention, full_batch, world)
    plain = model(kind, attention).train()
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net = DistributedDataParallel(plain)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    loss = net(**local).loss
    loss.backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.grad, expected_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{where} grad {name}: {m}")
    optimizer.step()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    assert abs(mean_loss.item() / world - expected_loss) <= 1e-6 * max(1.0, abs(expected_loss)), where
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} {name}: {m}")
    check_tied(plain, where + " after a step")
    if rank == 0:
        with open(workdir / "report.jsonl", "a") as report:
            report.write(json.dumps({"kind": kind, "attention": attention, "mode": "ddp-gc", "loss": expected_loss}) + "\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--cases", required=True, help="comma-separated kind:attention pairs")
    parser.add_argument("--modes", default="fsdp2,fsdp1", help="fsdp2, fsdp1 and/or ddp-gc")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for case in args.cases.split(","):
            kind, attention = case.split(":")
            for mode in args.modes.split(","):
                if mode == "ddp-gc":
                    check_ddp_checkpointing(kind, attention, args.workdir)
                else:
                    check(kind, attention, mode, args.workdir)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
