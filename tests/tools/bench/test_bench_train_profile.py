"""tools/bench/train --profile: the kernel-name classifier on real H200 kernel names, the per-step
table against hand sums, and the whole --profile run on a tiny CPU shape (CPU profiler events)."""

import json

import pytest
from click.testing import CliRunner

from tools.bench.kernel_profile import CATEGORIES, classify_kernel, summarise_kernels
from tools.bench.train import main

# Kernel names as torch.profiler prints them for the drafter step on an H200 (cuBLAS, aten, inductor).
REAL_KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
    "kernel__5x_cublas": "gemm",
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>"
    "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)": "gemm",
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>"
    "(cublasSplitKParams<float>, __nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, "
    "float const*, __nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, void*, long, float*, int*)": "gemm",
    "triton_poi_fused__to_copy_add_mul_silu_0": "elementwise",
    "triton_poi_fused__to_copy_3": "copy/cast",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "reduction",
    "triton_per_fused__to_copy_mul_sum_2": "reduction",
    "triton_red_fused__log_softmax_gather_4": "softmax/loss",
    "triton_tem_fused_0": "attention",
    "triton_tem_fused_zeros_1": "attention",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
    "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)": "elementwise",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
    "BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::"
    "TensorIteratorBase&, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::"
    "MulFunctor<float> > const&)::{lambda(int)#1}>(int, ...)": "elementwise",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
    "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "softmax/loss",
    "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, at::native::"
    "(anonymous namespace)::LogSoftMaxBackwardEpilogue>(float*, float const*, float const*, long)": "softmax/loss",
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::direct_copy_kernel_"
    "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::"
    "{lambda(float)#1}, std::array<char*, 2ul> >(int, ...)": "copy/cast",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#3}::operator()() const::{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1}, "
    "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, ...>": "copy/cast",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
    "OpaqueType<2u>, unsigned int, 2, 128, 1>(...)": "copy/cast",
    "Memcpy DtoD (Device -> Device)": "copy/cast",
    "Memset (Device)": "elementwise",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
    "(at::native::ADAM_MODE)1, true>, double*, double, double, double, double, double, bool, float const*, "
    "float const*>(...)": "optimizer",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4, 4>)": "reduction",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float, float, "
    "float>, unsigned int, float, 4, 4> >(...)": "reduction",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...>": "other",
    "void at::native::_scatter_gather_elementwise_kernel<128, 4, ...>": "other",
    "void at_cuda_detail::cub::DeviceSegmentedRadixSortKernel<...>": "other",
    "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false>"
    "(pytorch_flash::Flash_fwd_params)": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": "attention",
    # CPU runs (aten ops by self time): the same categories.
    "aten::mm": "gemm",
    "aten::addmm": "gemm",
    "aten::_log_softmax": "softmax/loss",
    "aten::_fused_adamw_": "optimizer",
    "aten::copy_": "copy/cast",
    "aten::_to_copy": "copy/cast",
    "aten::mul": "elementwise",
    "aten::sum": "reduction",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::searchsorted": "other",
}


@pytest.mark.parametrize("name", sorted(REAL_KERNELS))
def test_classify_kernel_on_real_names(name):
    assert classify_kernel(name) == REAL_KERNELS[name], name


def test_summarise_kernels_against_hand_sums():
    nvjet, add, cast = "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "triton_poi_fused_add_0", "triton_poi_fused__to_copy_1"
    kernels = [(nvjet, 600.0), (add, 100.0), (cast, 50.0), (cast, 50.0)] * 2  # two steps, microseconds
    s = summarise_kernels(kernels, num_steps=2)
    assert s["kernel_ms_per_step"] == pytest.approx(0.8)
    assert s["kernels_per_step"] == 4 and s["copy_cast_kernels_per_step"] == 2
    assert s["categories"]["gemm"] == {"ms_per_step": pytest.approx(0.6), "percent": 75.0, "kernels_per_step": 1}
    assert s["categories"]["copy/cast"]["percent"] == pytest.approx(12.5)
    assert s["categories"]["elementwise"]["ms_per_step"] == pytest.approx(0.1)
    assert set(s["categories"]) == set(CATEGORIES)
    assert [k["name"] for k in s["top_kernels"]] == [nvjet, add, cast]
    with pytest.raises(ValueError, match="num_steps"):
        summarise_kernels(kernels, num_steps=0)


def test_profile_runs_end_to_end_on_a_tiny_cpu_shape(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--sizes", "tiny", "--modes", "eager", "--steps", "1", "--profile", "--compare-plain"]
    result = CliRunner().invoke(main, [*args, "--profile-steps", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "copy/cast kernels per step" in result.output
    plain, r = json.loads(out.read_text())["results"]
    assert not any(plain["step_options"][name] for name in ("weight_copies", "fused_loss", "compile_pointwise"))
    assert r["step_options"]["fused_loss"] and r["step_options"]["weight_copies"]
    profile = r["profile"]
    assert profile["steps"] == 1 and profile["kernel_ms_per_step"] > 0
    assert sum(c["percent"] for c in profile["categories"].values()) == pytest.approx(100.0)
    assert profile["categories"]["gemm"]["ms_per_step"] > 0 and profile["categories"]["optimizer"]["kernels_per_step"]
    assert r["ms_per_query_token"] == pytest.approx(r["step_ms"] / r["query_tokens"])
    assert r["mfu"] is None and r["matmul_peak_share"] is None  # no peak on CPU: not made up
    assert r["peak_mem_gib"] is None


@pytest.mark.gpu
def test_mfu_is_against_the_datasheet_peak_and_the_matmul_share_is_apart(tmp_path):
    """One MFU across the project: the bench divides by the same datasheet peak as the training CLI."""
    import torch

    from train.metrics.flops import peak_flops

    out = tmp_path / "bench.json"
    args = ["--device", "cuda", "--sizes", "launch", "--modes", "eager", "--steps", "2", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    (r,) = report["results"]
    datasheet, _ = peak_flops(torch.device("cuda:0"), torch.bfloat16)
    assert report["datasheet_bf16_peak_flops"] == datasheet
    if datasheet is not None:
        assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / datasheet)
    assert r["matmul_peak_share"] == pytest.approx(r["tflops"] * 1e12 / report["measured_bf16_matmul_flops"])


def test_one_run_benches_dflash1_and_dflash2_side_by_side(tmp_path):
    """tiny and tiny2 (the DFlash 2 layout at the same width) in one run; the selector's codebooks are
    not counted as matmul FLOPs."""
    from tools.bench.train_workload import SIZES, drafter_config
    from train.drafter.model import count_parameters

    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--sizes", "tiny,tiny2", "--modes", "eager", "--steps", "1", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    one, two = json.loads(out.read_text())["results"]
    assert (one["arch"], two["arch"]) == ("dflash", "dflash2")
    assert two["layer_types"] == ["sliding_attention"] * 2 and two["sliding_window"] == 2048
    cfg2 = drafter_config(SIZES["tiny2"])
    codebooks = 2 * cfg2.vocab_size * cfg2.selector_rank
    assert two["params"] == count_parameters(cfg2)
    fc_and_norms = cfg2.num_taps * cfg2.hidden_size**2 + 2 * cfg2.hidden_size
    assert two["flops_per_step"]["layers"] == 6 * (two["params"] - fc_and_norms - codebooks) * two["query_tokens"]


def test_one_run_compares_bf16_fp8_linears_and_fp8_head(tmp_path):
    """--compare-fp8: bf16, --fp8 linears and --fp8 linears+head of one size in one run (CPU: emulated),
    named apart in the table; the same FLOPs, and FP8's rounding moves the loss."""
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--sizes", "tiny", "--modes", "eager", "--steps", "1", "--compare-fp8"]
    result = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())["results"]
    assert [r["step_options"]["fp8"] for r in results] == ["off", "linears", "linears+head"]
    assert [r["flops_per_step"] for r in results[1:]] == [results[0]["flops_per_step"]] * 2
    losses = [r["mean_loss"] for r in results]
    assert len(set(losses)) == 3 and max(losses) - min(losses) < 1e-2 * abs(losses[0]), losses
    rows = [line.split() for line in result.output.splitlines() if line.startswith("tiny ")]
    assert [row[2] for row in rows] == ["copies+loss", "copies+loss+fp8", "copies+loss+fp8+head"]
