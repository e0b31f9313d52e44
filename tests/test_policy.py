"""The execution policy (`hf_zformer/modeling/policy.py`) and its report (`explain.py`): the path each
attention layer takes on a CPU in fp32 and under bf16 autocast, on a GPU under bf16 autocast (asked
from this machine: `explain` reads shapes and device types, never a kernel), and under
`HF_ZFORMER_KERNELS=torch`; `use_policy` as the one switch, restored on exit; and no path switch
left outside the policy."""

import ast
import functools
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO_ROOT, tiny_config
from transformers import AutoModel, AutoModelForCausalLM

from hf_zformer.modeling import ops, policy, triton_ops
from hf_zformer.modeling.explain import explain, format_report
from hf_zformer.modeling.policy import use_policy

MODELING = REPO_ROOT / "hf_zformer" / "modeling"
LONG, SHORT = 80, 8  # tokens: past the width (32), where the folded forms and the pooled output pay off; below it
KERNELS = pytest.mark.skipif(not triton_ops.RUNNABLE, reason="a GPU's paths are the kernels' only where triton runs")


def _encoder():
    """One encoder layer of each type (zformer, fastformer, full), width 32, 4 heads."""
    config = tiny_config(attention_type=["zformer", "fastformer", "full"], num_hidden_layers=3,
                         max_position_embeddings=128)
    return AutoModel.from_config(config).eval()


def _paths(rows):
    return [row["paths"] for row in rows]


def _ids(length, batch=2):
    return {"input_ids": torch.ones(batch, length, dtype=torch.long)}


CPU_LONG = [
    {"form": "folded"},
    {"form": "folded", "shared_direction_pool": "torch", "column_scale": "torch"},
    {"form": "plain", "projection": "torch", "softmax_attention": "sdpa"},
]
CPU_SHORT = [
    {"form": "plain", "projection": "torch", "linear_attention": "torch"},
    {"form": "plain", "projection": "torch", "direction_pool": "torch"},
    {"form": "plain", "projection": "torch", "softmax_attention": "sdpa"},
]


def test_explain_on_a_cpu_in_fp32_and_under_bf16_autocast():
    """A CPU: the folded forms from N > D, in fp32 and under bf16 autocast alike (the policy's
    `folded_autocast`); below, the plain forms with their torch operations."""
    model = _encoder()
    assert _paths(explain(model, _ids(LONG))) == CPU_LONG
    assert _paths(explain(model, _ids(SHORT))) == CPU_SHORT
    assert _paths(explain(model, _ids(LONG), autocast=torch.bfloat16)) == CPU_LONG
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the autocast in force is the default
        rows = explain(model, _ids(LONG))
    assert _paths(rows) == CPU_LONG and rows[0]["autocast"] == "bfloat16"
    assert _paths(explain(model, _ids(LONG), autocast=torch.float16))[:2] == [  # fp16: no fold
        {"form": "plain", "projection": "torch", "linear_attention": "torch"},
        {"form": "pooled", "projection": "torch", "direction_pool": "torch", "fused_product": "torch",
         "column_scale": "torch"},
    ]


@KERNELS
def test_explain_on_a_gpu_under_bf16_autocast():
    """CUDA under bf16 autocast: the plain forms with their kernels, the projections stacked
    (rows >= D), fastformer's pooled output from N >= D with the column scaling's kernel and not
    the experimental fused product; a causal LM's prefix pooling through its kernel."""
    model = _encoder()
    rows = explain(model, _ids(LONG), device="cuda", autocast=torch.bfloat16, grad=False)
    assert {row["device"] for row in rows} == {"cuda"}
    assert _paths(rows) == [
        {"form": "plain", "projection": "stacked", "linear_attention": "triton"},
        {"form": "pooled", "projection": "stacked", "direction_pool": "triton", "fused_product": "torch",
         "column_scale": "triton"},
        {"form": "plain", "projection": "stacked", "softmax_attention": "sdpa"},
    ]
    short = explain(model, _ids(SHORT, batch=1), device="cuda", autocast=torch.bfloat16)  # 8 rows < D: unstacked
    assert _paths(short)[:2] == [{"form": "plain", "projection": "torch", "linear_attention": "triton"},
                                 {"form": "plain", "projection": "torch", "direction_pool": "triton"}]
    decoder = AutoModelForCausalLM.from_config(tiny_config(model_type="fastformer", is_decoder=True)).eval()
    rows = explain(decoder, {**_ids(SHORT), "use_cache": False}, device="cuda", autocast=torch.bfloat16, grad=False)
    assert {row["role"] for row in rows} == {"causal"}
    assert _paths(rows)[0] == {"form": "plain", "projection": "torch", "causal_softmax_pool": "triton"}
    with use_policy(fused_product=("cuda",)):  # the experimental kernel, where asked for
        rows = explain(model, _ids(LONG), device="cuda", autocast=torch.bfloat16)
    assert _paths(rows)[1]["fused_product"] == "triton" and "column_scale" not in _paths(rows)[1]


def test_explain_under_the_torch_backend_names_torch_everywhere():
    model = _encoder()
    with ops.use_kernel_backend("torch"):
        rows = explain(model, _ids(LONG), device="cuda", autocast=torch.bfloat16)
        assert _paths(explain(model, _ids(LONG))) == CPU_LONG  # the folded forms are torch's own
    assert _paths(rows) == [
        {"form": "plain", "projection": "torch", "linear_attention": "torch"},
        {"form": "pooled", "projection": "torch", "direction_pool": "torch", "fused_product": "torch",
         "column_scale": "torch"},
        {"form": "plain", "projection": "torch", "softmax_attention": "sdpa"},
    ]
    text = format_report(rows)
    assert text.splitlines()[0].startswith("encoder.layers.0.attention [ZformerAttention, self, cuda float32 "
                                           "autocast bfloat16, N=80, D=32]: form=plain")


def test_the_environment_variable_sets_the_backend():
    script = textwrap.dedent("""
        import torch
        from hf_zformer.modeling import policy
        from hf_zformer.modeling.explain import explain
        from transformers import AutoConfig, AutoModel
        assert policy.active().backend == "torch", policy.active()
        config = AutoConfig.for_model("fastformer", hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                      intermediate_size=8, vocab_size=10, max_position_embeddings=128)
        rows = explain(AutoModel.from_config(config), {"input_ids": torch.ones(2, 80, dtype=torch.long)},
                       device="cuda", autocast=torch.bfloat16)
        assert set(rows[0]["paths"].values()) == {"pooled", "torch"}, rows
    """)
    env = {**os.environ, "HF_ZFORMER_KERNELS": "torch", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_use_policy_changes_entries_and_restores_them_on_exit():
    before = policy.active()
    with use_policy(stacked_projection="cpu", folded_autocast={"fastformer": ("cuda",)}, pool_chunk=None) as chosen:
        assert policy.active() is chosen and chosen.stacked_projection == ("cpu",) and chosen.pool_chunk is None
        assert chosen.folded_autocast_devices("fastformer") == ("cuda",)
        assert chosen.folded_autocast_devices("zformer") == ("cpu",)  # merged, not replaced
        with use_policy(backend="torch"):
            assert ops.kernel_backend() == "torch" and policy.active().stacked_projection == ("cpu",)
        assert policy.active() is chosen
    assert policy.active() is before
    with pytest.raises(RuntimeError), use_policy(folded=False):
        raise RuntimeError("inside")
    assert policy.active() is before
    with pytest.raises(ValueError, match="'fast'"):
        with use_policy(backend="fast"):
            pass
    with pytest.raises(TypeError):
        with use_policy(no_such_entry=1):
            pass
    assert policy.active() is before


def test_experimental_kernels_are_off_every_default_path():
    default = policy.Policy()
    assert default.experimental.fused_product == ()
    assert not any(default.fused_product_wanted(device, dtype) for device in ("cpu", "cuda")
                   for dtype in (torch.float32, torch.bfloat16))
    assert default.replaced(backend="triton").fused_product_wanted("cuda", torch.float32)  # forced
    assert default.replaced(fused_product="cuda").experimental.fused_product == ("cuda",)


def test_a_module_of_its_own_overrides_the_policys_folded_autocast():
    model = _encoder()
    zformer = model.encoder.layers[0].attention
    zformer.folded_autocast_devices = ()
    rows = explain(model, _ids(LONG), autocast=torch.bfloat16)
    assert rows[0]["paths"]["form"] == "plain" and rows[1]["paths"]["form"] == "folded"
    with use_policy(folded=False):
        assert {row["paths"]["form"] for row in explain(model, _ids(LONG))} == {"plain", "pooled"}


# the switches that lived in modeling/ before the policy held them, and the environment it alone reads
OLD_SWITCHES = {
    "_backend", "FUSED_PRODUCT_DEVICES", "STACKED_PROJECTION_DEVICES", "FOLDED_AUTOCAST_DEVICES", "FUSED_MIN_PAIRS",
    "POOL_CHUNK", "ZFORMER_CAUSAL_BLOCK", "FASTFORMER_CAUSAL_QUADRATIC", "_PRODUCT_TILES", "FEW_ROWS",
}


def _assigned_names(tree: ast.Module) -> set[str]:
    """Names assigned at module level or in a class body."""
    names = set()
    bodies = [tree.body] + [node.body for node in tree.body if isinstance(node, ast.ClassDef)]
    for body in bodies:
        for node in body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def test_no_path_switch_outside_the_policy():
    found = []
    for path in [*sorted(MODELING.glob("*.py")), MODELING.parent / "cpu_speedups.py"]:  # and the opt-in layers
        if path.name == "policy.py":
            continue
        text = path.read_text()
        found += [f"{path.name}: {name}" for name in _assigned_names(ast.parse(text)) & OLD_SWITCHES]
        found += [f"{path.name} reads {name}" for name in ("HF_ZFORMER_KERNELS", "TRITON_INTERPRET")
                  if f'environ.get("{name}"' in text]
    assert not found, found


def test_the_gpu_ab_script_patches_nothing():
    """docs/bench/ab/fastformer_gpu.py reaches every variant through `use_policy`: it assigns no
    attribute of anything and calls no setattr."""
    tree = ast.parse((REPO_ROOT / "docs" / "bench" / "ab" / "fastformer_gpu.py").read_text())
    assigned = [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                and any(isinstance(target, ast.Attribute)
                        for target in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    calls = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "setattr"]
    assert not assigned and not calls, (assigned, calls)


def test_the_documented_examples_run(capsys):
    """docs/benchmarks.md, "Which path runs where": its examples (an encoder, a decoder) run and
    print what they say."""
    text = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    section = text.split("### Which path runs where", 1)[1].split("\n### ", 1)[0]
    encoder, decoder = (block.split("```", 1)[0] for block in section.split("```python\n")[1:])
    exec(compile(encoder, "docs/benchmarks.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "form=folded" in lines[0] and "form=pooled" in lines[1]
    if triton_ops.RUNNABLE:
        assert "direction_pool=triton" in lines[1] and "fused_product=triton" in lines[2]
    exec(compile(decoder, "docs/benchmarks.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and "form=windowed" in lines[0] and "causal_form=blocks" in lines[0]
    assert "softmax_attention=sdpa" in lines[1] and lines[3].endswith("softmax_attention=sdpa")
    assert "N=1, past=100" in lines[2] and lines[2].endswith("windowed_attention=decode_step")


def test_kernel_modules_are_one_family_each_and_short():
    """The Triton kernels live one family to a module (with the helpers they share in
    triton_launch.py), none past ~600 lines; triton_ops.py only gathers their names."""
    kernels = sorted(MODELING.glob("triton_*.py"))
    assert {path.name for path in kernels} >= {"triton_launch.py", "triton_linear_attention.py", "triton_pooling.py",
                                               "triton_shared_pool.py", "triton_prefix_pool.py", "triton_product.py"}
    lengths = {path.name: len(path.read_text().splitlines()) for path in kernels}
    assert max(lengths.values()) <= 600, lengths
    assert "@triton.jit" not in (MODELING / "triton_ops.py").read_text()


# ----------------------------------------------------------------------------------------------
# Llama-family decoders (`attention_llama`): one converted decoder of each kind
# ----------------------------------------------------------------------------------------------

DECODER_KINDS = {
    "zformer": dict(attention_type="zformer", zformer_feature_map="hedgehog"),
    "windowed": dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=4),
    "memory": dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=4, attention_memory=2,
                   attention_memory_chunk=2),
    "memory-cache-positions": dict(attention_type="zformer", zformer_feature_map="hedgehog", attention_window=4,
                                   attention_memory=2, attention_memory_chunk=2, attention_memory_positions="cache"),
    "fastformer": dict(attention_type="fastformer"),
    "full": dict(attention_type="full"),
}
PROMPT = 16  # tokens of a prompt: past the window (4), within one causal block (64)
FLA = triton_ops.RUNNABLE and importlib.util.find_spec("fla") is not None


@functools.cache
def _decoder(kind):
    from test_llama_decoder import tiny_llama

    from hf_zformer.conversion.convert_decoder import convert_causal_lm

    return convert_causal_lm("tiny", source=tiny_llama(), **DECODER_KINDS[kind]).eval()


def _decoder_paths(kind, length=PROMPT, **options):
    """The one path dict every layer of the `kind` decoder reports for `length` new tokens."""
    rows = explain(_decoder(kind), {"input_ids": torch.ones(1, length, dtype=torch.long),
                                    **options.pop("inputs", {})}, **options)
    assert len(rows) == 3 and {row["role"] for row in rows} == {"causal"}
    assert all(row["paths"] == rows[0]["paths"] for row in rows), rows
    return rows[0]["paths"]


LLAMA = {"form": "plain", "projection": "torch"}  # q_proj, k_proj, v_proj: one product each
CPU_DECODER = {  # kind: (a prompt with a cache, the same without one, a decoding step after 16 tokens)
    "zformer": ({**LLAMA, "linear_attention": "torch", "causal_form": "blocks"},
                {**LLAMA, "linear_attention": "torch", "causal_form": "quadratic"},
                {**LLAMA, "linear_attention": "torch", "causal_form": "step"}),
    "windowed": ({**LLAMA, "form": "windowed", "windowed_attention": "general", "linear_attention": "torch",
                  "causal_form": "quadratic"},) * 2 + ({**LLAMA, "form": "windowed", "windowed_attention": "decode_step"},),
    "memory": ({**LLAMA, "form": "memory", "memory_attention": "torch", "memory_positions": "text"},) * 3,
    "memory-cache-positions": ({**LLAMA, "form": "memory", "memory_attention": "torch", "memory_positions": "cache"},) * 3,
    "fastformer": ({**LLAMA, "causal_softmax_pool": "torch", "causal_form": "prefix"},
                   {**LLAMA, "causal_softmax_pool": "torch", "causal_form": "quadratic"},
                   {**LLAMA, "causal_softmax_pool": "torch", "causal_form": "prefix"}),
    "full": ({**LLAMA, "softmax_attention": "sdpa"},) * 3,
}


@pytest.mark.parametrize("kind", list(DECODER_KINDS))
def test_explain_a_converted_decoder_on_a_cpu(kind):
    """A CPU in fp32 and under bf16 autocast: the torch forms, each in the order the call's shape
    and cache pick (`ops.causal_form`, `ops.causal_pool_form`, `attention.steady_decoding`)."""
    prompt, uncached, step = CPU_DECODER[kind]
    assert _decoder_paths(kind) == prompt
    assert _decoder_paths(kind, inputs={"use_cache": False}) == uncached
    assert _decoder_paths(kind, 1, past=PROMPT) == step
    assert _decoder_paths(kind, autocast=torch.bfloat16) == prompt
    assert _decoder_paths(kind, 1, past=PROMPT, autocast=torch.bfloat16) == step


def test_explain_a_windowed_decoders_steps_while_the_window_fills():
    """A decoding step takes `windowed_decode_step` once the cache holds the W - 1 tokens before it,
    all real; before, the general form with the older tokens in the state alone (none at first)."""
    general = {**LLAMA, "form": "windowed", "windowed_attention": "general"}
    assert _decoder_paths("windowed", 1, past=1) == {**general, "linear_attention": "torch", "causal_form": "state"}
    assert _decoder_paths("windowed", 1, past=3) == {**LLAMA, "form": "windowed", "windowed_attention": "decode_step"}
    padded = torch.ones(1, PROMPT + 1, dtype=torch.long)
    padded[0, -2] = 0  # padding inside the window: the general form, the cached keys all in the window
    assert _decoder_paths("windowed", 1, past=PROMPT, inputs={"attention_mask": padded}) == {
        **general, "linear_attention": "torch", "causal_form": "state"}


@pytest.mark.parametrize("kind", list(DECODER_KINDS))
def test_explain_a_converted_decoder_on_a_gpu_under_bf16_autocast(kind):
    """CUDA under bf16 autocast, asked from this machine (no grad, as generation runs): fla's chunked
    kernel for a prompt's causal linear attention where fla runs, the prefix pooling's kernel for a
    prompt (no state in), the torch forms for a decoding step; sdpa for softmax attention."""
    gpu = dict(device="cuda", autocast=torch.bfloat16, grad=False)
    prompt, step = _decoder_paths(kind, **gpu), _decoder_paths(kind, 1, past=PROMPT, **gpu)
    linear = {"linear_attention": "fla"} if FLA else {"linear_attention": "torch", "causal_form": "blocks"}
    pool = {"causal_softmax_pool": "triton"} if triton_ops.RUNNABLE else {"causal_softmax_pool": "torch",
                                                                          "causal_form": "prefix"}
    windowed = {"linear_attention": "fla"} if FLA else {"linear_attention": "torch", "causal_form": "quadratic"}
    expected = {
        "zformer": {**LLAMA, **linear},
        "windowed": {**LLAMA, "form": "windowed", "windowed_attention": "general", **windowed},
        "fastformer": {**LLAMA, **pool},
        "memory": CPU_DECODER["memory"][0],
        "memory-cache-positions": CPU_DECODER["memory-cache-positions"][0],
        "full": CPU_DECODER["full"][0],
    }
    assert prompt == expected[kind]
    assert step == CPU_DECODER[kind][2]
    with ops.use_kernel_backend("torch"):  # the reference: every operation in its torch form
        assert _decoder_paths(kind, **gpu) == CPU_DECODER[kind][0]
        assert _decoder_paths(kind, 1, past=PROMPT, **gpu) == step
    with use_policy(fla_devices=()):
        assert "fla" not in _decoder_paths(kind, **gpu).values()


def test_explain_reports_what_a_converted_decoder_runs(monkeypatch):
    """On this CPU, the forms a prompt, a decoding step and a call without a cache actually run (the
    torch forms' functions, recorded) are the ones `explain` reports for them."""
    from hf_zformer.modeling import attention, ops_linear_attention, ops_pooling

    ran = []
    for module, name, form in [(ops_linear_attention, "quadratic_linear_attention", "quadratic"),
                               (ops_linear_attention, "causal_linear_attention", "blocks"),
                               (ops_linear_attention, "per_head_product", "step"),
                               (ops_pooling, "causal_softmax_pool", "quadratic"),
                               (ops_pooling, "prefix_pool", "prefix"),
                               (attention, "windowed_decode_step", "decode_step"),
                               (attention, "memory_self_attention", "memory")]:
        function = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=function, _form=form, **k: ran.append(_form) or _f(*a, **k))
    names = {"causal_form", "windowed_attention", "form"}
    for kind in ("zformer", "windowed", "memory", "fastformer"):
        model, ids = _decoder(kind), torch.randint(3, 50, (1, PROMPT))
        with torch.no_grad():
            cache = model.model.new_cache()
            for inputs in ({"cache": cache}, {"use_cache": False}, None):
                ran.clear()
                if inputs is None:  # a decoding step after the prompt
                    model(ids[:, :1], cache=cache)
                    reported = _decoder_paths(kind, 1, past=PROMPT)
                else:
                    model(ids, **inputs)
                    reported = _decoder_paths(kind, inputs={"use_cache": "cache" in inputs})
                assert ran and ran[0] in {reported[name] for name in names if name in reported}, (  # the first layer's
                    kind, inputs, ran, reported)
