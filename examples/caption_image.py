#!/usr/bin/env python3
"""caption_image.py: caption an image with a Qwen3-VL model through kvlite's C API, from Python's standard
library alone (ctypes): no build step, no package to install. The caption streams to stdout.

    python3 examples/caption_image.py [--library build-lib/libkvlite.so] [--prompt TEXT] [--max-tokens N]
                                      [--backend auto|cpu|cuda] MODEL_DIR IMAGE

libkvlite.so comes from `make lib` (build-lib/libkvlite.so, CPU-only, a minute or two) or `make build`
(build/libkvlite.so; option KVLITE_BUILD_SHARED). Exit
status: 0 done, 1 kvlite refused (the message says why), 2 usage error.
"""
import argparse
import ctypes
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
KVLITE_OK = 0
BACKENDS = {"auto": 0, "cpu": 1, "cuda": 2}


# The C structs of kvlite.hpp's C API, field for field (struct_size first: kvlite_*_init sets it).
class Options(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("backend", ctypes.c_int32), ("device", ctypes.c_int32),
                ("device_mem", ctypes.c_uint64), ("utilization", ctypes.c_double),
                ("max_model_len", ctypes.c_int64), ("max_seqs", ctypes.c_int64),
                ("max_batched_tokens", ctypes.c_int64), ("kv_dtype", ctypes.c_char_p),
                ("max_image_pixels", ctypes.c_int64), ("max_images", ctypes.c_int64),
                ("kv_fill", ctypes.c_int32), ("threads", ctypes.c_int32),
                ("name", ctypes.c_char_p), ("log", ctypes.c_void_p), ("log_user_data", ctypes.c_void_p),
                ("log_level", ctypes.c_int32)]


class Sampling(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("temperature", ctypes.c_float), ("top_k", ctypes.c_int64),
                ("top_p", ctypes.c_float), ("min_p", ctypes.c_float), ("repetition_penalty", ctypes.c_float),
                ("seed", ctypes.c_uint64), ("max_tokens", ctypes.c_int64),
                ("stop_tokens", ctypes.POINTER(ctypes.c_int32)), ("n_stop_tokens", ctypes.c_size_t),
                ("stop_strings", ctypes.POINTER(ctypes.c_char_p)), ("n_stop_strings", ctypes.c_size_t),
                ("ignore_eos", ctypes.c_int32), ("request_out", ctypes.POINTER(ctypes.c_int64)),
                ("grammar", ctypes.c_char_p), ("json_schema", ctypes.c_char_p)]


class Generation(ctypes.Structure):
    _fields_ = [("ids", ctypes.POINTER(ctypes.c_int32)), ("n_ids", ctypes.c_size_t),
                ("n_prompt_ids", ctypes.c_size_t), ("text", ctypes.c_char_p), ("finish_reason", ctypes.c_int32),
                ("request", ctypes.c_int64)]


TOKEN_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int32, ctypes.c_void_p)


def load(path):
    lib = ctypes.CDLL(path)
    lib.kvlite_version.restype = ctypes.c_char_p
    lib.kvlite_last_error.restype = ctypes.c_char_p
    lib.kvlite_status_name.restype = ctypes.c_char_p
    lib.kvlite_options_init.argtypes = [ctypes.POINTER(Options)]
    lib.kvlite_sampling_init.argtypes = [ctypes.POINTER(Sampling)]
    lib.kvlite_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(Options), ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.POINTER(ctypes.c_void_p)]
    lib.kvlite_close.argtypes = [ctypes.c_void_p]
    lib.kvlite_image_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.kvlite_image_free.argtypes = [ctypes.c_void_p]
    lib.kvlite_generate_chat.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.POINTER(Sampling), TOKEN_FN, ctypes.c_void_p,
        ctypes.POINTER(Generation)]
    lib.kvlite_generation_free.argtypes = [ctypes.POINTER(Generation)]
    return lib


def default_library():
    """make lib's build-lib/libkvlite.so, else make build's build/libkvlite.so."""
    for build in ("build-lib", "build"):
        path = os.path.join(HERE, "..", build, "libkvlite.so")
        if os.path.exists(path):
            return path
    return os.path.join(HERE, "..", "build-lib", "libkvlite.so")


def main():
    parser = argparse.ArgumentParser(description="Caption an image with kvlite through its C API (ctypes).")
    parser.add_argument("model_dir")
    parser.add_argument("image")
    parser.add_argument("--library", default=os.environ.get("KVLITE_LIBRARY", default_library()))
    parser.add_argument("--prompt", default="Describe this image.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="auto")
    args = parser.parse_args()
    if args.max_tokens < 1:
        parser.error("--max-tokens needs a positive integer")
    try:
        lib = load(args.library)
    except OSError as error:
        print(f"caption_image.py: cannot load {args.library}: {error} (build it: make lib)", file=sys.stderr)
        return 2

    def failed(status):
        print(f"caption_image.py: {lib.kvlite_last_error().decode()} ({lib.kvlite_status_name(status).decode()})",
              file=sys.stderr)
        return 1

    image = ctypes.c_void_p()
    status = lib.kvlite_image_load(args.image.encode(), ctypes.byref(image))
    if status != KVLITE_OK:
        return failed(status)
    options = Options()
    lib.kvlite_options_init(ctypes.byref(options))
    # *_init writes the C struct's size: a mirror that lags the header is found here, not as a wrong field later
    if options.struct_size != ctypes.sizeof(Options):
        print(f"caption_image.py: Options is {ctypes.sizeof(Options)} bytes, kvlite_options is {options.struct_size}: "
              "update the mirror to kvlite.hpp's", file=sys.stderr)
        return 1
    options.backend = BACKENDS[args.backend]
    engine = ctypes.c_void_p()
    status = lib.kvlite_open(args.model_dir.encode(), ctypes.byref(options), None, None, ctypes.byref(engine))
    if status != KVLITE_OK:
        lib.kvlite_image_free(image)
        return failed(status)
    try:
        sampling = Sampling()
        lib.kvlite_sampling_init(ctypes.byref(sampling))  # greedy
        if sampling.struct_size != ctypes.sizeof(Sampling):
            print(f"caption_image.py: Sampling is {ctypes.sizeof(Sampling)} bytes, kvlite_sampling is "
                  f"{sampling.struct_size}: update the mirror to kvlite.hpp's", file=sys.stderr)
            return 1
        sampling.max_tokens = args.max_tokens

        @TOKEN_FN
        def on_token(piece, token_id, user_data):
            sys.stdout.write(piece.decode("utf-8"))
            sys.stdout.flush()
            return 1  # go on

        roles = (ctypes.c_char_p * 1)(b"user")
        placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
        contents = (ctypes.c_char_p * 1)((placeholder + args.prompt).encode())
        images = (ctypes.c_void_p * 1)(image)
        generation = Generation()
        status = lib.kvlite_generate_chat(engine, roles, contents, 1, images, 1, ctypes.byref(sampling), on_token,
                                          None, ctypes.byref(generation))
        if status != KVLITE_OK:
            return failed(status)
        lib.kvlite_generation_free(ctypes.byref(generation))
        sys.stdout.write("\n")
        return 0
    finally:
        lib.kvlite_close(engine)
        lib.kvlite_image_free(image)


if __name__ == "__main__":
    sys.exit(main())
