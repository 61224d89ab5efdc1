"""Compile every Triton kernel of mode/kernels/ for an H100 (sm_90), on a machine without a GPU.

    python tests/compile_kernels.py      # prints one line per kernel; exit status 1 if any fails

Triton's interpreter, which runs the kernels on CPU in the tests, accepts code the compiler
rejects (a global that is not a constexpr, for one); compiling ahead of time to PTX for sm_90
needs no GPU and catches those. Run by tests/test_kernels.py in a process of its own, because
mode.kernels must be imported without TRITON_INTERPRET for its kernels to be compilable.
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mode.kernels import (  # noqa: E402
    adamw,
    cross_entropy,
    decision,
    decode_attention,
    expert_choice,
    gelu,
    grad_norm,
    grouped_mm,
    null_experts,
    rms_norm,
    rotary,
    rows,
    softmax_topk,
    sort_rows,
    step_cache,
    swiglu,
    topk,
    weighted_sums,
)

BF16, F32, I64, I32, I32P = "*bf16", "*fp32", "*i64", "i32", "*i32"


def put_gated_rows(x: str, has_ids: bool, gate: int, has_keep: bool = True) -> tuple:
    """One variant of a routed layer's one-kernel update (rows.put_gated_rows_): x's dtype, row ids
    and kept rows or not (another pointer stands in, as put_gated_rows_ passes), the gate kind
    (rows.GATE_KINDS)."""
    ids = I64 if has_ids else BF16
    return (rows, "_put_gated_rows", dict(x_ptr=x, ids_ptr=ids, keep_ptr="*u8" if has_keep else ids, a_ptr=BF16,
                                          b_ptr=BF16, gates_ptr=F32, n_rows=I32, width=I32, HAS_IDS=has_ids,
                                          HAS_KEEP=has_keep, GATE=gate, BLOCK_R=4, BLOCK_D=256))

# (module, kernel, argument types in order (constexpr arguments as values), as the layers launch it)
KERNELS = [
    (rotary, "_rotary_qkv_fwd", dict(qkv_ptr=BF16, out_ptr=BF16, cos_ptr=F32, sin_ptr=F32, seq=I32, cos_stride_b=I32,
                                     cos_stride_s=I32, H=16, HALF=32, BLOCK_H=16, BLOCK_D=32)),
    (rotary, "_rotary_qkv_bwd", dict(dq_ptr=BF16, dk_ptr=BF16, dv_ptr=BF16, dqkv_ptr=BF16, cos_ptr=F32, sin_ptr=F32,
                                     seq=I32, cos_stride_b=I32, cos_stride_s=I32, dq_sb=I32, dq_ss=I32, dq_sh=I32,
                                     dk_sb=I32, dk_ss=I32, dk_sh=I32, dv_sb=I32, dv_ss=I32, dv_sh=I32,
                                     H=16, HALF=32, BLOCK_H=16, BLOCK_D=32)),
    # the cached forward's in-place rotation of q and k: 16 + 16 heads of 64
    (rotary, "_rotate_in_place", dict(x_ptr=BF16, cos_ptr=F32, sin_ptr=F32, seq=I32, stride_n=I32, stride_s=I32,
                                      stride_h=I32, cos_stride_b=I32, cos_stride_s=I32, H=32, HALF=32, BLOCK_H=32,
                                      BLOCK_D=32)),
    (swiglu, "_swiglu_fwd", dict(h_ptr=BF16, gates_ptr=BF16, out_ptr=BF16, width=I32, GATED=False, BLOCK=4096)),
    (swiglu, "_swiglu_fwd", dict(h_ptr=BF16, gates_ptr=F32, out_ptr=BF16, width=I32, GATED=True, BLOCK=4096)),
    (swiglu, "_swiglu_bwd", dict(h_ptr=BF16, grad_ptr=BF16, dh_ptr=BF16, width=I32, BLOCK=1024)),
    (swiglu, "_gated_swiglu_bwd", dict(h_ptr=BF16, grad_ptr=BF16, gates_ptr=F32, dh_ptr=BF16, grad_gates_ptr=F32,
                                       width=I32, BLOCK=2048)),
    (cross_entropy, "_cross_entropy_fwd_grad", dict(logits_ptr=BF16, targets_ptr=I64, grad_ptr=BF16, loss_ptr=F32,
                                                    vocab=I32, BLOCK=2048)),
    (topk, "_top_k_positions", dict(scores_ptr=F32, out_ptr=I64, flat_ptr=I64, tokens=I32, k=I32, FLAT=False, BLOCK=2048)),
    (topk, "_top_k_positions", dict(scores_ptr=F32, out_ptr=I64, flat_ptr=I64, tokens=I32, k=I32, FLAT=True, BLOCK=2048)),
    (softmax_topk, "_forward", dict(logits_ptr=F32, gates_ptr=F32, slots_ptr=I64, partial_ptr=F32, tokens=I32,
                                    n_slots=I32, inv_tokens="fp32", K=2, BLOCK_T=256, BLOCK_S=8)),
    (softmax_topk, "_finalize", dict(partial_ptr=F32, summary_ptr=F32, aux_ptr=F32, programs=I32, n_slots=I32,
                                     n_experts=I32, capacity=I32, inv_assignments="fp32", lb_weight="fp32",
                                     z_weight="fp32", BLOCK_P=32, BLOCK_S=8)),
    # Triton specializes integer arguments equal to 1 into constants: one program, capacity 1.
    (softmax_topk, "_finalize", dict(partial_ptr=F32, summary_ptr=F32, aux_ptr=F32, programs=1, n_slots=I32,
                                     n_experts=I32, capacity=1, inv_assignments="fp32", lb_weight="fp32",
                                     z_weight="fp32", BLOCK_P=32, BLOCK_S=8)),
    (softmax_topk, "_forward", dict(logits_ptr=F32, gates_ptr=F32, slots_ptr=I64, partial_ptr=F32, tokens=1,
                                    n_slots=1, inv_tokens="fp32", K=1, BLOCK_T=256, BLOCK_S=1)),
    (softmax_topk, "_backward", dict(logits_ptr=F32, slots_ptr=I64, grad_gates_ptr=F32, summary_ptr=F32,
                                     grad_aux_ptr=F32, grad_logits_ptr=F32, tokens=I32, n_slots=I32, inv_tokens="fp32",
                                     lb_scale="fp32", z_weight="fp32", K=2, BLOCK_T=256, BLOCK_S=8)),
    (rows, "_sum_rows", dict(rows_ptr=BF16, gates_ptr=F32, inverse_ptr=I32P, scores_grad_ptr=BF16, weight_ptr=BF16,
                             out_ptr=BF16, tokens=I32, width=I32, J=8, J_PAD=8,
                             HAS_GATES=True, S=0, BLOCK_T=2, BLOCK_D=1024)),
    (rows, "_sum_rows", dict(rows_ptr=BF16, gates_ptr=BF16, inverse_ptr=I32P, scores_grad_ptr=BF16, weight_ptr=BF16,
                             out_ptr=BF16, tokens=I32, width=I32, J=1, J_PAD=1,
                             HAS_GATES=False, S=0, BLOCK_T=2, BLOCK_D=1024)),
    # expert choice's gather backward with the router's input gradient: bf16 router, and float32
    (rows, "_sum_rows", dict(rows_ptr=BF16, gates_ptr=BF16, inverse_ptr=I32P, scores_grad_ptr=BF16, weight_ptr=BF16,
                             out_ptr=BF16, tokens=I32, width=I32, J=8, J_PAD=8,
                             HAS_GATES=False, S=8, BLOCK_T=2, BLOCK_D=512)),
    (rows, "_sum_rows", dict(rows_ptr=BF16, gates_ptr=BF16, inverse_ptr=I32P, scores_grad_ptr=F32, weight_ptr=F32,
                             out_ptr=BF16, tokens=I32, width=I32, J=8, J_PAD=8,
                             HAS_GATES=False, S=10, BLOCK_T=2, BLOCK_D=512)),
    (expert_choice, "_select", dict(probs_ptr=F32, logits_ptr=F32, indices_ptr=I64, ids_ptr=I64, gates_ptr=F32,
                                    inverse_ptr=I32P, taken_ptr="*i8", partial_ptr=F32, groups=I32, tokens=I32,
                                    n_slots=I32, n_experts=I32, capacity=I32, z_share=I32,
                                    BLOCK=2048, BLOCK_Z=128, BLOCK_S=8)),
    (expert_choice, "_select", dict(probs_ptr=F32, logits_ptr=F32, indices_ptr=I64, ids_ptr=I64, gates_ptr=F32,
                                    inverse_ptr=I32P, taken_ptr="*i8", partial_ptr=F32, groups=1, tokens=I32,
                                    n_slots=I32, n_experts=1, capacity=1, z_share=I32,
                                    BLOCK=4096, BLOCK_Z=128, BLOCK_S=2)),
    (expert_choice, "_finalize", dict(partial_ptr=F32, taken_ptr="*i8", summary_ptr=F32, aux_ptr=F32, programs=I32,
                                      n_tokens=I32, n_experts=I32, rows_per_expert="fp32", inv_tokens="fp32",
                                      z_weight="fp32", BLOCK_P=64, BLOCK_N=2048, BLOCK_E=64)),
    (expert_choice, "_finalize", dict(partial_ptr=F32, taken_ptr="*i8", summary_ptr=F32, aux_ptr=F32, programs=1,
                                      n_tokens=I32, n_experts=1, rows_per_expert="fp32", inv_tokens="fp32",
                                      z_weight="fp32", BLOCK_P=64, BLOCK_N=2048, BLOCK_E=64)),
    (expert_choice, "_backward", dict(logits_ptr=F32, inverse_ptr=I32P, grad_gates_ptr=F32, grad_aux_ptr=F32,
                                      grad_null_ptr=F32, grad_logits_ptr=BF16, tokens=I32, n_slots=I32, n_experts=I32,
                                      z_scale="fp32", HAS_AUX=False, HAS_NULL=False, BLOCK_T=256, BLOCK_S=8)),
    (expert_choice, "_backward", dict(logits_ptr=F32, inverse_ptr=I32P, grad_gates_ptr=F32, grad_aux_ptr=F32,
                                      grad_null_ptr=F32, grad_logits_ptr=F32, tokens=I32, n_slots=I32, n_experts=1,
                                      z_scale="fp32", HAS_AUX=True, HAS_NULL=False, BLOCK_T=128, BLOCK_S=16)),
    # with copy / constant null experts: every token's no-op slot probabilities' gradient too
    (expert_choice, "_backward", dict(logits_ptr=F32, inverse_ptr=I32P, grad_gates_ptr=F32, grad_aux_ptr=F32,
                                      grad_null_ptr=F32, grad_logits_ptr=F32, tokens=I32, n_slots=I32, n_experts=I32,
                                      z_scale="fp32", HAS_AUX=True, HAS_NULL=True, BLOCK_T=16, BLOCK_S=16)),
    # GELU experts with their gates
    (gelu, "_gated_gelu_fwd", dict(h_ptr=BF16, gates_ptr=F32, out_ptr=BF16, width=I32, BLOCK=4096)),
    (gelu, "_gated_gelu_bwd", dict(h_ptr=BF16, grad_ptr=BF16, gates_ptr=F32, dh_ptr=BF16, grad_gates_ptr=F32,
                                   width=I32, BLOCK=1024)),
    # token choice's rows sorted by expert (dropless, and with a capacity): top-1 and top-2 over 8 experts
    (sort_rows, "_count", dict(slots_ptr=I64, positions_ptr=I64, counts_ptr=I32P, n=I32, tokens=I32, n_experts=I32,
                               K=1, RANK_MAJOR=False, BLOCK_N=1024, BLOCK_K=16)),
    (sort_rows, "_count", dict(slots_ptr=I64, positions_ptr=I64, counts_ptr=I32P, n=I32, tokens=I32, n_experts=I32,
                               K=2, RANK_MAJOR=True, BLOCK_N=1024, BLOCK_K=16)),
    (sort_rows, "_place_capacity", dict(slots_ptr=I64, counts_ptr=I32P, positions_ptr=I64, table_ptr=I64, ids_ptr=I64,
                                        inverse_ptr=I32P, n=I32, tokens=I32, n_experts=I32, capacity=I32,
                                        programs=I32, K=1, BLOCK_N=1024, BLOCK_K=16, BLOCK_P=16)),
    (sort_rows, "_place_capacity", dict(slots_ptr=I64, counts_ptr=I32P, positions_ptr=I64, table_ptr=I64, ids_ptr=I64,
                                        inverse_ptr=I32P, n=I32, tokens=I32, n_experts=I32, capacity=I32,
                                        programs=I32, K=2, BLOCK_N=1024, BLOCK_K=16, BLOCK_P=32)),
    (sort_rows, "_place", dict(slots_ptr=I64, positions_ptr=I64, counts_ptr=I32P, gates_ptr=I64, ids_ptr=I64,
                               gate_index_ptr=I64, row_gates_ptr=I64, inverse_ptr=I32P, ends_ptr=I32P, n=I32,
                               n_experts=I32, programs=I32, K=1, BLOCK_N=1024, BLOCK_K=16, BLOCK_P=16,
                               HAS_GATES=False)),
    (sort_rows, "_place", dict(slots_ptr=I64, positions_ptr=I64, counts_ptr=I32P, gates_ptr=I64, ids_ptr=I64,
                               gate_index_ptr=I64, row_gates_ptr=I64, inverse_ptr=I32P, ends_ptr=I32P, n=I32,
                               n_experts=I32, programs=I32, K=2, BLOCK_N=1024, BLOCK_K=16, BLOCK_P=32,
                               HAS_GATES=False)),
    # a decode step's layout with its rows' gates (MoEFFN's static pass): top-1 over 8 experts, 256 rows
    (sort_rows, "_place", dict(slots_ptr=I64, positions_ptr=I64, counts_ptr=I32P, gates_ptr=F32, ids_ptr=I64,
                               gate_index_ptr=I64, row_gates_ptr=F32, inverse_ptr=I32P, ends_ptr=I32P, n=I32,
                               n_experts=I32, programs=I32, K=1, BLOCK_N=256, BLOCK_K=16, BLOCK_P=1,
                               HAS_GATES=True)),
    # the float32 stream's rows gathered into bf16 for the experts
    (rows, "_gather_rows", dict(x_ptr=F32, ids_ptr=I64, out_ptr=BF16, n_rows=I32, width=I32, BLOCK_R=4, BLOCK_D=512)),
    # the copy and constant no-op slots added to an MoE FFN's bf16 output (copy, constants, both), and back
    (null_experts, "_null_add", dict(out_ptr=BF16, x_ptr=F32, scale_ptr=F32, gates_ptr=F32, v_ptr=F32, res_ptr=BF16,
                                     tokens=I32, width=I32, C=0, HAS_COPY=True, BLOCK_T=2, BLOCK_D=1024)),
    (null_experts, "_null_add", dict(out_ptr=BF16, x_ptr=F32, scale_ptr=BF16, gates_ptr=F32, v_ptr=F32, res_ptr=BF16,
                                     tokens=I32, width=I32, C=8, HAS_COPY=False, BLOCK_T=2, BLOCK_D=1024)),
    (null_experts, "_null_add", dict(out_ptr=BF16, x_ptr=F32, scale_ptr=F32, gates_ptr=F32, v_ptr=F32, res_ptr=BF16,
                                     tokens=I32, width=I32, C=3, HAS_COPY=True, BLOCK_T=2, BLOCK_D=1024)),
    (null_experts, "_null_add_backward", dict(grad_ptr=BF16, x_ptr=F32, scale_ptr=F32, v_ptr=BF16, grad_x_ptr=F32,
                                              grad_scale_ptr=F32, grad_gates_ptr=BF16, tokens=I32, width=I32, C=0,
                                              C_PAD=1, HAS_COPY=True, BLOCK_T=64, BLOCK_D=64)),
    (null_experts, "_null_add_backward", dict(grad_ptr=F32, x_ptr=F32, scale_ptr=BF16, v_ptr=F32, grad_x_ptr=BF16,
                                              grad_scale_ptr=BF16, grad_gates_ptr=F32, tokens=I32, width=I32, C=8,
                                              C_PAD=8, HAS_COPY=False, BLOCK_T=64, BLOCK_D=64)),
    (null_experts, "_null_add_backward", dict(grad_ptr=F32, x_ptr=BF16, scale_ptr=F32, v_ptr=F32, grad_x_ptr=BF16,
                                              grad_scale_ptr=F32, grad_gates_ptr=F32, tokens=I32, width=I32, C=3,
                                              C_PAD=4, HAS_COPY=True, BLOCK_T=64, BLOCK_D=64)),
    # rows summed with a few weights each: constant slots' gradient (bf16 rows) and a router's (float32)
    (weighted_sums, "_weighted_row_sums", dict(weights_ptr=F32, rows_ptr=BF16, group_sums_ptr=F32, tokens=I32,
                                               width=I32, rows_per_group=I32, C=3, C_DOT=16, BLOCK_T=32, BLOCK_D=64)),
    (weighted_sums, "_weighted_row_sums", dict(weights_ptr=F32, rows_ptr=F32, group_sums_ptr=F32, tokens=I32,
                                               width=I32, rows_per_group=I32, C=40, C_DOT=64, BLOCK_T=32,
                                               BLOCK_D=64)),
    # a depth router's gated update of the float32 residual, and its backward (float32 incoming gradient)
    (rows, "_add_gated_rows", dict(x_ptr=F32, ids_ptr=I64, gates_ptr=F32, rows_ptr=BF16, n_rows=I32, width=I32,
                                   BLOCK_R=4, BLOCK_D=256)),
    # a compacted decode step's routed update, bf16 rows into bf16 and float32 hidden states
    put_gated_rows(x=BF16, has_ids=True, gate=0),
    put_gated_rows(x=F32, has_ids=True, gate=0),
    # the router's scores gated in the kernel: compacted rows (sigmoid) and a masked step (identity)
    put_gated_rows(x=BF16, has_ids=True, gate=2),
    put_gated_rows(x=BF16, has_ids=False, gate=1),
    # a decode step's experts: [gate | up] and down over a few bf16 rows
    (grouped_mm, "_grouped_rows_mm", dict(x_ptr=BF16, w_ptr=BF16, ends_ptr=I32P, out_ptr=BF16, K=I32, N=I32,
                                          BLOCK_M=16, BLOCK_N=128, BLOCK_K=64)),
    (grouped_mm, "_grouped_rows_mm", dict(x_ptr=BF16, w_ptr=BF16, ends_ptr=I32P, out_ptr=BF16, K=I32, N=I32,
                                          BLOCK_M=64, BLOCK_N=64, BLOCK_K=128)),
    # a prefill's routed update of its packed tokens: every row kept
    put_gated_rows(x=BF16, has_ids=True, gate=2, has_keep=False),
    (rows, "_combine_backward", dict(grad_ptr=F32, ids_ptr=I64, rows_ptr=BF16, gates_ptr=F32, grad_rows_ptr=BF16,
                                     grad_gates_ptr=F32, n_rows=I32, width=I32, BLOCK_R=4, BLOCK_D=512)),
    (rows, "_combine_backward", dict(grad_ptr=BF16, ids_ptr=I64, rows_ptr=BF16, gates_ptr=F32, grad_rows_ptr=BF16,
                                     grad_gates_ptr=F32, n_rows=I32, width=I32, BLOCK_R=4, BLOCK_D=512)),
    # a decode step's decision: batch 1 (n_rows specialized to 1) and larger, with and without bias
    (decision, "_decide", dict(x_ptr=BF16, w_ptr=F32, b_ptr=F32, active_ptr="*u8", scores_ptr=F32, chosen_ptr="*u8",
                               n_rows=1, width=I32, HAS_BIAS=False, HAS_ACTIVE=True, BLOCK_R=4, BLOCK_D=512)),
    (decision, "_decide", dict(x_ptr=BF16, w_ptr=F32, b_ptr=F32, active_ptr="*u8", scores_ptr=F32, chosen_ptr="*u8",
                               n_rows=I32, width=I32, HAS_BIAS=True, HAS_ACTIVE=False, BLOCK_R=4, BLOCK_D=512)),
    (decision, "_compact", dict(chosen_ptr="*u8", lengths_ptr=I64, base_ptr=I64, rows_ptr=I64, keep_ptr="*u8",
                                write_ptr=I64, used_ptr=I64, batch=I32, width=I32, max_len=I32, BLOCK=1024)),
    (decision, "_compact", dict(chosen_ptr="*u8", lengths_ptr=I64, base_ptr=I64, rows_ptr=I64, keep_ptr="*u8",
                                write_ptr=I64, used_ptr=I64, batch=I32, width=1, max_len=I32, BLOCK=8)),
    # a static decode step's attention input: every row (slots computed; no row ids) and compacted rows
    # (row ids, slots given; q stands in for the pointers a variant does not read), as _launch passes them
    (step_cache, "_rotate_write", dict(qkv_ptr=BF16, row_stride=I32, cos_ptr=F32, sin_ptr=F32, rows_ptr=BF16,
                                       q_ptr=BF16, cache_ptr=BF16, half="i64", keep_ptr="*u8", lengths_ptr=I64,
                                       base_ptr=I64, write_ptr=BF16, used_ptr=I64, max_len=I32, H=16, HKV=16, HALF=32,
                                       BLOCK_H=16, BLOCK_HKV=16, BLOCK_D=32, HAS_ROWS=False, GIVEN_SLOTS=False)),
    (step_cache, "_rotate_write", dict(qkv_ptr=BF16, row_stride=I32, cos_ptr=F32, sin_ptr=F32, rows_ptr=I64,
                                       q_ptr=BF16, cache_ptr=BF16, half=I32, keep_ptr=BF16, lengths_ptr=BF16,
                                       base_ptr=BF16, write_ptr=I64, used_ptr=BF16, max_len=I32, H=16, HKV=4, HALF=64,
                                       BLOCK_H=16, BLOCK_HKV=4, BLOCK_D=64, HAS_ROWS=True, GIVEN_SLOTS=True)),
    # a static decode step's layer output: a float32 stream plus a bf16 FFN output, and all bf16
    (rows, "_put_sum", dict(x_ptr=F32, h_ptr=F32, b_ptr=BF16, keep_ptr="*u8", out_ptr=F32, n_rows=I32, width=I32,
                            BLOCK_R=4, BLOCK_D=256)),
    (rows, "_put_sum", dict(x_ptr=BF16, h_ptr=BF16, b_ptr=BF16, keep_ptr="*u8", out_ptr=BF16, n_rows=I32, width=I32,
                            BLOCK_R=4, BLOCK_D=256)),
    # AdamW on float32 masters from their bf16 gradients, writing the bf16 copies: many tensors, and one
    # (staged for a CUDA graph: conditional on `active`, each step count advanced first); from float32
    # gradients summed over micro-batches; float32 weights
    (adamw, "_adamw_masters", dict(table_ptr=I64, n_tensors=I32, grad_scale_ptr=F32, lr_ptr=F32, active_ptr=F32,
                                   beta1="fp32", beta2="fp32", log_beta1="fp32", log_beta2="fp32", eps="fp32",
                                   decay="fp32", BLOCK=1024, TENSORS=64, HAS_ACTIVE=False, HAS_COPY=True,
                                   GRAD_FLOAT32=False)),
    (adamw, "_adamw_masters", dict(table_ptr=I64, n_tensors=1, grad_scale_ptr=F32, lr_ptr=F32, active_ptr=F32,
                                   beta1="fp32", beta2="fp32", log_beta1="fp32", log_beta2="fp32", eps="fp32",
                                   decay="fp32", BLOCK=1024, TENSORS=1, HAS_ACTIVE=True, HAS_COPY=True, GRAD_FLOAT32=False)),
    (adamw, "_adamw_masters", dict(table_ptr=I64, n_tensors=I32, grad_scale_ptr=F32, lr_ptr=F32, active_ptr=F32,
                                   beta1="fp32", beta2="fp32", log_beta1="fp32", log_beta2="fp32", eps="fp32",
                                   decay="fp32", BLOCK=1024, TENSORS=64, HAS_ACTIVE=False, HAS_COPY=True,
                                   GRAD_FLOAT32=True)),
    (adamw, "_adamw_masters", dict(table_ptr=I64, n_tensors=I32, grad_scale_ptr=F32, lr_ptr=F32, active_ptr=F32,
                                   beta1="fp32", beta2="fp32", log_beta1="fp32", log_beta2="fp32", eps="fp32",
                                   decay="fp32", BLOCK=1024, TENSORS=64, HAS_ACTIVE=False, HAS_COPY=False,
                                   GRAD_FLOAT32=True)),
    (adamw, "_count_steps", dict(table_ptr=I64, n_tensors=I32, active_ptr=F32, TENSORS=8)),
    # the gradients' global norm: each block's sum of squares, bf16 and float32 gradients
    (grad_norm, "_block_squares", dict(table_ptr=I64, owner_ptr=I32P, n_tensors=I32, out_ptr=F32, BLOCK=4096,
                                       FLOAT32=False)),
    (grad_norm, "_block_squares", dict(table_ptr=I64, owner_ptr=I32P, n_tensors=I32, out_ptr=F32, BLOCK=4096,
                                       FLOAT32=True)),
    # the norms of the float32 residual stream into bf16 (with the residual add, and a float32 output)
    (rms_norm, "_rms_norm_fwd", dict(x_ptr=F32, a_ptr=F32, w_ptr=F32, h_ptr=F32, y_ptr=BF16, rstd_ptr=F32, width=I32,
                                     eps="fp32", ADD=False, BLOCK=1024)),
    (rms_norm, "_rms_norm_fwd", dict(x_ptr=F32, a_ptr=BF16, w_ptr=F32, h_ptr=F32, y_ptr=F32, rstd_ptr=F32, width=I32,
                                     eps="fp32", ADD=True, BLOCK=8192)),
    (rms_norm, "_rms_norm_bwd", dict(x_ptr=F32, w_ptr=F32, rstd_ptr=F32, dy_ptr=BF16, dh_ptr=BF16, dx_ptr=F32,
                                     da_ptr=F32, dw_part_ptr=F32, rows=I32, width=I32, HAS_DH=False, ADD=False,
                                     BLOCK=1024)),
    (rms_norm, "_rms_norm_bwd", dict(x_ptr=F32, w_ptr=F32, rstd_ptr=F32, dy_ptr=BF16, dh_ptr=F32, dx_ptr=F32,
                                     da_ptr=BF16, dw_part_ptr=F32, rows=I32, width=I32, HAS_DH=True, ADD=True,
                                     BLOCK=8192)),
    (decode_attention, "_decode_attention", dict(q_ptr=BF16, kv_ptr=BF16, rows_ptr=I64, used_ptr=I64, out_ptr=BF16,
                                                 slots=I32, half=I32, scale="fp32", H=16, GROUPS=1, HD=64,
                                                 HAS_ROWS=True, BLOCK_N=128)),
    (decode_attention, "_decode_attention", dict(q_ptr=BF16, kv_ptr=BF16, rows_ptr=I64, used_ptr=I64, out_ptr=BF16,
                                                 slots=I32, half=I32, scale="fp32", H=16, GROUPS=4, HD=128,
                                                 HAS_ROWS=False, BLOCK_N=128)),
    (decode_attention, "_decode_attention", dict(q_ptr="*fp32", kv_ptr="*fp32", rows_ptr=I64, used_ptr=I64,
                                                 out_ptr="*fp32", slots=I32, half=I32, scale="fp32", H=4, GROUPS=1,
                                                 HD=8, HAS_ROWS=False, BLOCK_N=128)),
]


def compile_all() -> list[str]:
    """Compile each kernel for sm_90; returns the failures (empty when all compile)."""
    failures = []
    for module, name, args in KERNELS:
        fn = getattr(module, name)
        if list(args) != fn.arg_names:
            failures.append(f"{module.__name__}.{name}: arguments {fn.arg_names}, this list has {list(args)}")
            continue
        signature = {a: (v if isinstance(v, str) else "constexpr") for a, v in args.items()}
        constexprs = {a: v for a, v in args.items() if not isinstance(v, str)}
        try:
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
            print(f"{module.__name__}.{name}: compiled for sm_90")
        except Exception as e:  # report every kernel, not only the first failure
            failures.append(f"{module.__name__}.{name}: {type(e).__name__}: {e}")
    return failures


if __name__ == "__main__":
    failed = compile_all()
    for line in failed:
        print("FAILED", line)
    sys.exit(1 if failed else 0)
