// ---------------------------------------------------------------------------------------------------------
// quant_formats: AWQ and GPTQ int4 checkpoints, read from their own on-disk layouts and repacked ONCE at load
// into the compressed-tensors pack-quantized view (quant.hpp) that the CPU matmul and the CUDA uploader already
// run: no per-format kernels, and act-order stays a g_idx that the GPU uploader turns into one permutation (as
// Marlin does), never a per-step gather.
//
// Layouts (N = out_features, K = in_features, G = groups = K / group_size; 1 for GPTQ group_size -1). Facts from
// AutoAWQ's / GPTQModel's packing code and vLLM's awq.py / gptq.py (read, not copied):
//   AWQ (AutoAWQ GEMM, quant_method "awq", version "gemm")
//     qweight I32 [K, N/8]: word (k, c) holds columns 8c .. 8c+7 of input row k; nibble i (bits 4i..4i+3) holds
//             column 8c + kAwqOrder[i], kAwqOrder = [0, 2, 4, 6, 1, 3, 5, 7] (the interleave AutoAWQ's GEMM
//             kernel dequantizes with; unpacking reads column offset j from nibble kAwqReverseOrder[j] =
//             [0, 4, 1, 5, 2, 6, 3, 7]). Stored u in 0..15.
//     qzeros  I32 [G, N/8]: the zero point z (0..15) per group and column, same interleave. zero_point false
//             (symmetric): vLLM's AWQ-Marlin reads no qzeros and uses z = 8; a qzeros tensor present is read.
//     scales  F16 [G, N].                      w[n, k] = (u - z) * scales[k / group_size, n]
//   GPTQ (AutoGPTQ / GPTQModel / optimum, quant_method "gptq")
//     qweight I32 [K/8, N]: word (i, n) holds input rows 8i .. 8i+7 of column n, row 8i + j at bits 4j.
//     qzeros  I32 [G, N/8]: word (g, c) holds columns 8c .. 8c+7, column 8c + j at bits 4j. checkpoint_format
//             "gptq" (v1, the default): the stored value is z - 1 (AutoGPTQ's pack subtracts 1, its kernels add
//             it back); "gptq_v2": z itself. sym true: z = 8.
//     scales  F16 [G, N].
//     g_idx   I32 [K]: input row k is in group g_idx[k]; k / group_size unless desc_act (act-order).
//                                              w[n, k] = (u - z[g_idx[k], n]) * scales[g_idx[k], n]
// The repacked view: weight_packed [N, K/8] with u as stored (compressed-tensors' nibble is q + 8 = u), zero points
// [ceil(N/8), G] packed along N holding z (its stored zero + 8 = z), scales [N, G], g_idx only for act-order (a
// g_idx equal to k / group_size is dropped). Then (q - zero) = (u - 8) - (z - 8) = u - z exactly, and one product
// rounded to the scales' dtype is the reference's dequantization (GPTQModel's torch kernel and vLLM's
// awq_dequantize both multiply the integer difference by the fp16 scale once).
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};         // nibble i holds column offset kAwqOrder[i]
constexpr int kAwqReverseOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // column offset j sits at nibble kAwqReverseOrder[j]

// The compressed-tensors view of an AWQ / GPTQ Linear (linear.packing != compressed_tensors), repacked from
// `store` into memory the view owns (QuantWeight::storage). Validates every tensor against the descriptor; errors
// name the tensor: bad_format (shapes, g_idx out of range or unbalanced groups), missing_tensor, unsupported (a
// GPTQ v1 zero stored as 15: z = 16 is outside int4's zero points).
Result<QuantWeight> repack_awq_gptq(const LinearDesc& linear, const TensorStore& store);

// The view of an int8 Linear (linear.format int8), every layout as one: signed q I8 [N, K], scales [N, G] as
// stored, zero points I8 [N, G] signed (nullptr when symmetric), g_idx only for act-order.
//   compressed-tensors int-quantized: weight I8 [N, K] (q), weight_scale, weight_zero_point I8 [N, G]: used in place.
//   compressed-tensors pack-quantized 8-bit: weight_packed I32 [N, K/4], byte j of word i holding column 4i + j as
//     q + 128; weight_zero_point I32 [ceil(N/4), G] packed along N the same way: repacked (q = byte - 128).
//   GPTQ 8-bit: qweight I32 [K/4, N] (row 4i + j at bits 8j of word (i, n)), qzeros I32 [G, N/4] (column 4c + j at
//     bits 8j; v1 stores z - 1), scales [G, N], g_idx [K]: repacked, q = u - 128, zero = z - 128 (sym: z = 128).
// w = (q - zero) * scale, rounded once to the scale's dtype, as compressed-tensors' dequantize and GPTQModel's
// torch kernel compute it.
Result<QuantWeight> int8_weight(const LinearDesc& linear, const TensorStore& store);

// Host bytes the repacked view of `linear` holds (0 for the layouts used in place: compressed-tensors int4 and
// int-quantized): what loading an AWQ / GPTQ / 8-bit packed Linear adds to its on-disk bytes on the CPU backend
// (the planner's repack row).
uint64_t repacked_host_bytes(const LinearDesc& linear);

}  // namespace kvlite
