"""bench gpu-hlo: the bare step compiled for an H100 on this CPU host (JAX's CUDA plugin,
deviceless), its kernels read back. The reading is checked on a module written by hand;
the whole command runs where `make install` put the plugin (.venv/gpu-aot)."""

import argparse
import json
import re
import shutil

import jax.numpy as jnp
import pytest

from attention_jax.attention import pallas
from attention_jax.tools.bench import gpu_hlo

# A compiled module as XLA:GPU writes one (trimmed): a Triton GEMM, a fusion that reads
# only slices of the GEMM's result, a Pallas kernel (a Triton custom call), views.
MODULE = """HloModule jit_train_step, entry_computation_layout={(bf16[64,32]{1,0})->bf16[64,8]{1,0}}

%gemm_fusion_dot.1_computation (p0: bf16[64,32], p1: bf16[32,24]) -> bf16[64,24] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,24]{1,0} parameter(1)
  ROOT %d = bf16[64,24]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add.2 (param_0.1: bf16[64,24], param_1.2: bf16[8]) -> bf16[64,8] {
  %param_0.1 = bf16[64,24]{1,0} parameter(0)
  %slice.3 = bf16[64,8]{1,0} slice(%param_0.1), slice={[0:64], [8:16]}
  %param_1.2 = bf16[8]{0} parameter(1)
  %broadcast.4 = bf16[64,8]{1,0} broadcast(%param_1.2), dimensions={1}
  ROOT %add.5 = bf16[64,8]{1,0} add(%slice.3, %broadcast.4)
}

ENTRY %main.9 (x: bf16[64,32], w: bf16[32,24], b: bf16[8]) -> bf16[64,8] {
  %x = bf16[64,32]{1,0} parameter(0), metadata={op_name="x"}
  %w = bf16[32,24]{1,0} parameter(1)
  %b = bf16[8]{0} parameter(2)
  %gemm_fusion_dot.1 = bf16[64,24]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation, metadata={op_name="jit(train_step)/jvp(GPT)/decoder/layer_0/layer_0/self_attention/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %loop_add_fusion.6 = bf16[64,8]{1,0} fusion(%gemm_fusion_dot.1, %b), kind=kLoop, calls=%fused_add.2, metadata={op_name="jit(train_step)/jvp(GPT)/decoder/layer_0/layer_0/self_attention/add"}
  %loop_add_fusion.7 = bf16[64,8]{1,0} fusion(%gemm_fusion_dot.1, %b), kind=kLoop, calls=%fused_add.2, metadata={op_name="jit(train_step)/jvp(GPT)/decoder/layer_1/layer_1/self_attention/add"}
  %pallas_call.8 = (bf16[64,8]{1,0}, f32[64]{0}) custom-call(%loop_add_fusion.6, %loop_add_fusion.7), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(GPT)/decoder/layer_0/layer_0/self_attention/flash_forward"}
  %get-tuple-element.9 = bf16[64,8]{1,0} get-tuple-element(%pallas_call.8), index=0
  ROOT %copy.10 = bf16[64,8]{1,0} copy(%get-tuple-element.9)
}
"""


def test_kernels_their_kinds_and_bytes_from_a_compiled_module():
    rows = {r["name"]: r for r in gpu_hlo.kernel_traffic(MODULE)}
    # parameters and views launch nothing
    assert set(rows) == {"gemm_fusion_dot.1", "loop_add_fusion.6", "loop_add_fusion.7",
                         "pallas_call.8", "copy.10"}
    assert rows["gemm_fusion_dot.1"]["kind"] == "matmul"
    assert rows["gemm_fusion_dot.1"]["flops"] == 2 * 64 * 24 * 32  # a multiply-add per pair
    assert rows["loop_add_fusion.6"]["flops"] == 0
    # the bias add reads only its slice of the GEMM's result (not a GEMM because its
    # line names one): 64x8 read + 8 bias + 64x8 written, bf16
    add = rows["loop_add_fusion.6"]
    assert add["kind"] == "memory" and add["bytes"] == 2 * (64 * 8 + 8 + 64 * 8)
    assert add["source"] == "jvp(GPT)/decoder/layer_0/layer_0/self_attention/add"
    assert rows["pallas_call.8"]["kind"] == "attention"
    assert rows["pallas_call.8"]["bytes"] == 2 * 2 * 64 * 8 + 2 * 64 * 8 + 4 * 64  # tuple result
    assert rows["copy.10"]["kind"] == "memory" and rows["copy.10"]["bytes"] == 2 * 2 * 64 * 8
    summary = gpu_hlo.summarize(list(rows.values()), bandwidth=1e9)
    assert summary["kinds"]["memory"]["kernels"] == 3
    assert summary["memory_bound_ms"] == pytest.approx(
        1e3 * summary["kinds"]["memory"]["bytes"] / 1e9)
    # the two layers' bias adds are one source, layer numbers folded
    top = summary["sources"][0]
    assert top == {"source": "jvp(GPT)/decoder/layer_N/self_attention/add", "kernels": 2,
                   "bytes": 2 * add["bytes"]}


def test_a_cublas_call_s_flops_from_its_dimension_numbers():
    """A cuBLAS GEMM (what the H100's autotuner may pick) names no computation: its FLOPs
    come from its operands and the contracting dimensions in its backend config."""
    module = """ENTRY %main.3 (x: bf16[4,128,64], w: bf16[32,64]) -> bf16[512,32] {
  %x = bf16[4,128,64]{2,1,0} parameter(0)
  %w = bf16[32,64]{1,0} parameter(1)
  %b = bf16[512,64]{1,0} bitcast(%x)
  ROOT %g = (bf16[512,32]{1,0}, s8[1024]{0}) custom-call(%b, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
}
"""
    (row,) = gpu_hlo.kernel_traffic(module)
    assert row["kind"] == "matmul" and row["flops"] == 2 * 512 * 32 * 64


def test_an_array_handed_to_a_kernel_twice_is_read_once():
    """The packed attention kernels take one [B, T, 3, N, H] array as q, k and v."""
    module = """ENTRY %main.3 (x: bf16[4,16,3,2,8]) -> bf16[4,16,2,8] {
  %x = bf16[4,16,3,2,8]{4,3,2,1,0} parameter(0)
  ROOT %pallas_call.2 = bf16[4,16,2,8]{3,2,1,0} custom-call(%x, %x, %x), custom_call_target="__gpu$xla.gpu.triton"
}
"""
    (row,) = gpu_hlo.kernel_traffic(module)
    assert row["kind"] == "attention" and row["bytes"] == 2 * (4 * 16 * 3 * 2 * 8 + 4 * 16 * 2 * 8)


def test_shape_bytes_of_arrays_and_tuples():
    assert gpu_hlo.shape_bytes("bf16[16,1024,768]{2,1,0}") == 2 * 16 * 1024 * 768
    assert gpu_hlo.shape_bytes("(f32[3]{0}, s32[], pred[2,2]{1,0})") == 12 + 4 + 4


def _args(*extra):
    parser = argparse.ArgumentParser()
    gpu_hlo.add_parser(parser.add_subparsers(dest="which"))
    return parser.parse_args(["gpu-hlo", "--shape", "gpt-tiny-gpu", *extra])


@pytest.mark.parametrize("registers, threads, shared, expected", [
    # 126 registers: 4032 a warp, given out as 4096, so 4 warps' worth in each of the 4
    # sub-partitions' 16,384 (2 programs of 8); the 64 KiB of shared memory would allow 3
    (126, 256, 65536, (2, "registers")),
    (152, 256, 65536, (1, "registers")),  # 4864 a warp: 3 a sub-partition, 12 warps
    (65, 32, 0, (28, "registers")),  # 2080 a warp given out as 2304: 7 a sub-partition
    (206, 32, 0, (8, "registers")),  # 6656 a warp: 2 a sub-partition (not 65536 // 6656 = 9)
    (80, 32, 0, (24, "registers")),  # 2560 a warp: 6 a sub-partition (not 25)
    (124, 256, 81920, (2, "registers, shared memory")),  # both bind: the dQ kernel's
    (40, 128, 102400, (2, "shared memory")),  # 100 KiB + 1 KiB reserved, into 228 KiB
    (16, 32, 45670, (4, "shared memory")),  # + 1 KiB = 46,694, as 46,720: 4 (unrounded, 5)
    (16, 1024, 0, (2, "threads")),  # 2048 threads an SM
    (16, 32, 0, (32, "programs")),  # 32 programs an SM, however small
    (128, 1024, 0, (0, "registers")),  # 131,072 registers: more than a program may have
])
def test_programs_an_sm_holds_by_cuda_s_occupancy_rules(registers, threads, shared, expected):
    assert gpu_hlo.programs_per_sm(registers, threads, shared) == expected


def test_launches_are_read_from_xla_s_thunk_sequence(tmp_path):
    (tmp_path / "module_0001.jit_step.thunk_sequence.txt").write_text(
        "001: kCustomKernel [source         | next=002 (1)  ] loop_add_fusion grid: [24576, 1, 1]"
        " threads: [128, 1, 1]  shared_memory: 0 bytes\n"
        "002: kCustomKernel [prev=001 (1)   | next=003 (1)  ] flash_forward grid: [8, 16, 12]"
        " threads: [256, 1, 1]  shared_memory: 65536 bytes\n"
        "003: kCustomKernel [prev=002 (1)   | next=004 (1)  ] flash_forward grid: [4, 1, 1]"
        " threads: [128, 1, 1]  shared_memory: 1024 bytes\n")
    assert gpu_hlo.launches(tmp_path) == {
        "loop_add_fusion": {"programs": 24576, "threads": 128, "shared_bytes": 0},
        "flash_forward": {"programs": 8 * 16 * 12, "threads": 256, "shared_bytes": 65536}}


def test_bad_batch_names_the_valid_values():
    with pytest.raises(SystemExit, match=r"--batch 0; valid: an integer >= 1"):
        gpu_hlo.run(_args("--batch", "0"))
    with pytest.raises(SystemExit, match=r"--loss-kernel 'cuda'; valid: \['auto', 'xla', 'pallas'\]"):
        gpu_hlo.run(_args("--loss-kernel", "cuda"))
    with pytest.raises(SystemExit, match=r"--loss-kernel 'xla,pallas'; valid: one of "
                                         r"\['auto', 'xla', 'pallas'\] \(this command compiles one step\)"):
        gpu_hlo.run(_args("--loss-kernel", "xla,pallas"))  # not the first of them, silently
    with pytest.raises(SystemExit, match=r"--norm-kernel 'triton'; valid: \['auto', 'xla', 'pallas'\]"):
        gpu_hlo.run(_args("--norm-kernel", "triton"))
    with pytest.raises(SystemExit, match=r"--norm-kernel 'xla,pallas'; valid: one of "):
        gpu_hlo.run(_args("--norm-kernel", "xla,pallas"))


@pytest.mark.skipif(gpu_hlo.plugin_path() is None,
                    reason="JAX's CUDA plugin is not installed (make install puts it in "
                           ".venv/gpu-aot)")
def test_the_step_compiles_for_an_h100_on_this_host(tmp_path, capsys):
    """The tiny GPT's step compiled for an H100 with no GPU here: XLA:GPU's kernels (its
    Triton GEMMs; the three Pallas kernels of the one layer's attention, lowered for
    Triton; the loss's gradient kernel), its memory-bound bytes, and its memory analysis."""
    out = tmp_path / "hlo"
    summary = gpu_hlo.run(_args("--out", str(out), "--top", "5", "--loss-kernel", "pallas",
                                "--kernel-code"))
    kinds = summary["kinds"]
    assert kinds["attention"]["kernels"] == 3  # forward, dK/dV, dQ
    # The loss by its kernels (auto's for GPT-2's vocabulary; the tiny one's is XLA's):
    # the gradient kernel over the logits, and no XLA reduction of them (their row max,
    # their Σ exp) left: the loss's XLA reductions are over per-row values only.
    sources = {g["source"]: g for g in summary["sources"]}
    assert "jvp(cross_entropy_gradient)/pallas_call" in sources
    row = summary["row"]
    logits_bytes = 2 * row["batch"] * row["seq_len"] * row["vocab"]
    loss_reductions = [g for s, g in sources.items() if s.startswith("jvp()/reduce")]
    assert loss_reductions and all(g["bytes"] < logits_bytes / 10 for g in loss_reductions)
    # The kernels read the one q, k, v projection in place, its bias folded into their
    # algebra: no bias add left to XLA.
    assert not [s for s in sources if s.endswith("self_attention/add")]
    assert kinds["matmul"]["kernels"] >= 6 and kinds["memory"]["kernels"] > 0
    # AdamW's updates: a launch per parameter array (16 here), but one for each norm's
    # vectors (its scale, bias and the bias of the projection before it, whose gradients
    # the norm's kernel sums as one array): 16 - 1 - 2 - 2. Summed as three arrays, 16
    # (and GPT-2 small's step 443 memory-bound launches, not 345).
    assert sources["add"]["kernels"] <= 11, sources["add"]
    # The biases the kernels add (q, k, v's in attention; the output projection's and
    # wo's in the norm after) reach them as the float32 parameters: no launch casts them
    # (two of the layer's four bias casts were `self_attention._bias/convert_element_type`).
    assert not [s for s in sources if s.endswith("_bias/convert_element_type")]
    assert sources["jvp(GPT)/decoder/layer_N/mlp/wo/convert_element_type"]["kernels"] == 1
    # Its matmuls multiply each weight once forward and twice backward, nothing more.
    assert kinds["matmul"]["flops"] == summary["weight_flops"] == gpu_hlo.weight_flops(row)
    assert summary["memory_bound_ms"] > 0
    assert summary["memory"]["temp_size_in_bytes"] > 0
    save = summary["save_compile"]  # the checkpoint's programs, for the same GPU
    assert save["arrays"] > 10 and save["copy_s"] > 0 and save["sums_s"] > 0
    assert 1 < save["flat_arrays"] < save["arrays"]  # packed: a flat array per entry and dtype
    text = (out / "step.hlo.txt").read_text()
    assert "__gpu$xla.gpu.triton" in text and "__triton" in text  # GPU kernels, not CPU's
    assert json.loads((out / "summary.json").read_text())["kinds"] == kinds
    printed = capsys.readouterr().out
    assert "as XLA compiles it for an NVIDIA H100 80GB HBM3 (no GPU used)" in printed
    assert printed.count("\n| `") == 5
    assert "The matmul kernels do 0.00 TFLOP, 1.000x what the model's weights need" in printed
    # --kernel-code: the Pallas kernels' PTX as XLA dumped it (registers where CUDA's
    # ptxas is on the PATH), each tile's exponentials ptx.py's pair.
    code = {r["kernel"]: r for r in summary["kernel_code"]}
    assert {"flash_forward", "flash_backward_dq", "flash_backward_dkdv",
            "cross_entropy_gradient"} <= set(code), sorted(code)
    assert all(r["instructions"] > 100 and r["fused_exp2"] > 0 for k, r in code.items()
               if not k.startswith("add_norm")), code
    assert all(("registers" in r) == bool(shutil.which("ptxas")) for r in code.values())
    assert "| kernel | PTX instructions | exp2 | as FFMA + MUFU.EX2 | threads |" in printed
    # Each kernel's launch as XLA makes it: the warps its tile sizes ask for, the tiles
    # staged in shared memory, a program per (query or key block, batch row, head).
    blocks = pallas.kernel_block_sizes(row["width"] // row["heads"], jnp.bfloat16, "gpu",
                                       length=row["seq_len"])
    forward, dkdv = code["flash_forward"], code["flash_backward_dkdv"]
    assert forward["threads"] == 32 * blocks.num_warps
    assert dkdv["threads"] == 32 * blocks.bwd_num_warps
    assert forward["shared_bytes"] > 0 and dkdv["shared_bytes"] > 0
    query_blocks = -(-row["seq_len"] // blocks.fwd_q)  # a short row padded to one block
    assert forward["programs"] == query_blocks * row["batch"] * row["heads"]
    assert code["cross_entropy_gradient"]["programs"] == row["batch"] * row["seq_len"]
    # The norm kernels' launch as the summary reports it (the defaults adapted to the
    # step's rows) is the one compiled: its grids follow from it.
    launch, rows = summary["norm_launch"], row["batch"] * row["seq_len"]
    assert code["add_norm_forward"]["programs"] == rows // launch["rows"]
    assert code["add_norm_backward"]["programs"] == rows // launch["program_rows"]
    assert code["add_norm_backward"]["threads"] == 32 * launch["num_warps"]
    assert "The norm kernels launch with {rows} rows a program at a time".format(
        **launch) in printed
    for r in code.values():
        if r.get("registers"):
            assert (r["per_sm"], r["per_sm_limit"]) == gpu_hlo.programs_per_sm(
                r["registers"], r["threads"], r["shared_bytes"])
            assert r["waves"] == pytest.approx(r["programs"] / (132 * r["per_sm"]))


@pytest.mark.skipif(gpu_hlo.plugin_path() is None,
                    reason="JAX's CUDA plugin is not installed (make install puts it in "
                           ".venv/gpu-aot)")
def test_launch_settings_reach_the_kernels_of_the_compiled_step(tmp_path, capsys):
    """--pallas-tiles, --loss-settings and --norm-settings: the step compiled with them
    launches each kernel as they say (a setting is screened here before a GPU sweeps it)."""
    summary = gpu_hlo.run(_args(
        "--loss-kernel", "pallas", "--kernel-code", "--pallas-tiles", "fwd=32x16,bwd=16x32,warps=2",
        "--loss-settings", "warps=16", "--norm-settings", "rows=2,program_rows=4,warps=1"))
    code = {r["kernel"]: r for r in summary["kernel_code"]}
    row = summary["row"]
    rows = row["batch"] * row["seq_len"]
    assert code["flash_forward"]["threads"] == 2 * 32  # warps=2
    # the row of 16 padded to the largest tile, 32: one key block of 32 (the defaults' 64
    # pad it to 128, two key blocks of 64)
    assert code["flash_backward_dkdv"]["programs"] == 1 * row["batch"] * row["heads"]
    assert code["cross_entropy_gradient"]["threads"] == 16 * 32
    assert code["add_norm_forward"]["programs"] == rows // 2
    assert code["add_norm_backward"]["programs"] == rows // 4
    assert code["add_norm_backward"]["threads"] == 32
    assert summary["settings"] == {"tiles": {"fwd_q": 32, "fwd_k": 16, "bwd_q": 16,
                                             "bwd_k": 32, "num_warps": 2},
                                   "loss": {"num_warps": 16},
                                   "norm": {"rows": 2, "program_rows": 4, "num_warps": 1}}
    assert summary["norm_launch"] == {"rows": 2, "program_rows": 4, "num_warps": 1}
    assert ("attention tiles fwd=32x16,bwd=16x32,warps=2, loss settings warps=16, "
            "norm settings rows=2,program_rows=4,warps=1.") in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, says", [
    ("--pallas-tiles", "fwd=48x64", "tile 48; valid: powers of two >= 16"),
    ("--loss-settings", "chunk=3", "chunk=3; valid: a power of two >= 16"),
    ("--norm-settings", "rows=16,program_rows=8", "valid: program_rows >= rows"),
])
def test_bad_launch_settings_name_the_valid_values(flag, value, says, capsys):
    with pytest.raises(SystemExit):
        _args(flag, value)
    assert says in capsys.readouterr().err


@pytest.mark.skipif(gpu_hlo.plugin_path() is None, reason="JAX's CUDA plugin is not installed")
@pytest.mark.parametrize("args, says", [
    (("--norm-settings", "rows=64,program_rows=64"),
     "--norm-settings: the norm kernels cannot take the step's rows: 32 rows per device, "
     "not a multiple of 64; valid: rows a power of two dividing 32"),
    (("--norm-settings", "rows=2", "--norm-kernel", "xla"),
     "--norm-settings is for the Pallas kernels, which --norm-kernel xla leaves out; valid: "
     "--norm-kernel pallas or auto"),
    (("--loss-settings", "warps=16", "--loss-kernel", "xla"),
     "--loss-settings is for the Pallas kernels, which --loss-kernel xla leaves out"),
    (("--pallas-tiles", "fwd=64x64", "--implementation", "xla"),
     "--pallas-tiles is for the Pallas kernels, which --implementation xla leaves out; "
     "valid: --implementation pallas"),
])
def test_launch_settings_the_step_would_not_use_are_refused(args, says, tmp_path, monkeypatch):
    """Before anything is compiled or written (no scratch folder is left behind)."""
    monkeypatch.setattr(gpu_hlo.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit, match=re.escape(says)):
        gpu_hlo.run(_args(*args))
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(gpu_hlo.plugin_path() is None, reason="JAX's CUDA plugin is not installed")
def test_a_failed_compile_says_xla_s_reason_not_the_plugin_s_noise():
    with pytest.raises(SystemExit, match=r"compiling for the GPU failed: .*Unknown flag in "
                                         r"XLA_FLAGS: --xla_gpu_no_such_option=true"):
        gpu_hlo.run(_args("--xla-flags=--xla_gpu_no_such_option=true"))
    # Repeated, all apply (the last one alone did: the bad first flag went unread).
    with pytest.raises(SystemExit, match=r"Unknown flag in XLA_FLAGS: --xla_gpu_no_such_option"):
        gpu_hlo.run(_args("--xla-flags=--xla_gpu_no_such_option=true",
                          "--xla-flags=--xla_gpu_enable_cublaslt=true"))
