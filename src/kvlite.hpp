// The root of kvlite's header parts. tools/amalgamate.sh inlines every `#include "..."` below (once each,
// in this order) into the single kvlite.hpp at the top of the repository. Edit the parts, never kvlite.hpp.
#include "manual.txt"
#ifndef KVLITE_HPP_INCLUDED
#define KVLITE_HPP_INCLUDED
#include "c_api.h"  // C and C++: from a C compiler, this is all kvlite.hpp declares
#ifdef __cplusplus
#include "base.hpp"
#include "safetensors.hpp"
#include "config.hpp"
#include "rope.hpp"
#include "quant.hpp"
#include "quant_formats.hpp"
#include "quant_gpu.hpp"
#include "jinja.hpp"
#include "tokenizer.hpp"
#include "image.hpp"
#include "device.hpp"
#include "plan.hpp"
#include "arena.hpp"
#include "sampler.hpp"
#include "grammar.hpp"
#include "backend.hpp"
#include "model.hpp"
#include "vision.hpp"
#include "engine.hpp"
#include "backend_cuda.hpp"
#endif  // __cplusplus
#endif  // KVLITE_HPP_INCLUDED

#if defined(__cplusplus) && defined(KVLITE_IMPLEMENTATION) && !defined(KVLITE_IMPLEMENTATION_INCLUDED)
#define KVLITE_IMPLEMENTATION_INCLUDED
#include "base.inl"
#include "safetensors.inl"
#include "config.inl"
#include "rope.inl"
#include "quant.inl"
#include "quant_formats.inl"
#include "quant_gpu.inl"
#include "tokenizer.inl"
#include "jinja.inl"
#include "image.inl"
#include "device.inl"
#include "plan.inl"
#include "arena.inl"
#include "sampler.inl"
#include "grammar.inl"
#include "backend.inl"
#include "backend_cpu.inl"
#include "model.inl"
#include "vision.inl"
#include "upload.inl"
#include "request.inl"
#include "scheduler.inl"
#include "batch.inl"
#include "speculative.inl"
#include "graphs.inl"
#include "engine.inl"
#include "backend_cuda.inl"
#include "c_api.inl"
#endif  // KVLITE_IMPLEMENTATION
