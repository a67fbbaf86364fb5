#!/usr/bin/env python3
"""Make the image-path fixtures (tests/fixtures/images/) with transformers' Qwen2-VL/Qwen3-VL image processor.

kvlite's tests/unit-image.cpp compares its decoder, smart_resize, bicubic resize, normalization and patch
order against what these files record, so every expected value comes from the reference implementation:

  * smart_resize: transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize on a list of
    (height, width, factor, min_pixels, max_pixels) cases, errors included;
  * resize: torchvision.transforms.v2.functional.resize(uint8, BICUBIC, antialias=True) on seeded noise
    (the call transformers' default torchvision backend makes; on a CPU it runs ATen's integer uint8 kernel);
  * the whole processor: AutoImageProcessor on a Qwen3-VL preprocessor_config.json, with small pixel budgets
    that force both up- and down-scaling: the grid, the resized uint8 image and pixel_values;
  * decoding: torchvision.io.decode_image (what the processor uses for a path; libjpeg-turbo, libpng) for
    PNG and JPEG, EXIF orientation included; Pillow for BMP, TGA, GIF and PNM, which torchvision cannot read;
  * RGBA arrays: the processor's convert_to_rgb (alpha composited onto white).

    /opt/kvdev/bin/python tools/make_image_fixtures.py

Outputs (about 0.8 MB, layout in tests/fixtures/images/README.md): source images in several formats; truth
images as PNG, each with the FNV-1a 64 of its exact pixels in cases.json so that a test first proves it
decoded the truth itself exactly (lossless decodes are recorded by that checksum alone); pixel_values as
float32 .npy; cases.json. Deterministic: seeded, byte-identical on rerun with the same package versions.
"""

import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import PIL
import PIL.Image
import torch
import torchvision
import transformers
from torchvision.io import ImageReadMode, decode_image, encode_jpeg, encode_png
from torchvision.transforms.v2 import functional as tvF
from transformers import AutoImageProcessor
from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT = REPO_ROOT / "tests" / "fixtures" / "images"

# Qwen/Qwen3-VL-*-Instruct preprocessor_config.json as published (size = MIN and MAX pixel counts).
QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


# ---- helpers shared with the C++ test ---------------------------------------------------------------------
def fnv1a64(data: bytes) -> str:
    """FNV-1a 64 of the bytes, as 16 hex digits (the test computes the same over decoded RGB bytes)."""
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def splitmix_bytes(seed: int, count: int) -> np.ndarray:
    """count bytes from splitmix64 (top byte of each output); unit-image.cpp regenerates the same inputs."""
    mask = 0xFFFFFFFFFFFFFFFF
    state = seed & mask
    out = np.empty(count, dtype=np.uint8)
    for i in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out[i] = z >> 56
    return out


def hwc_bytes(chw: torch.Tensor) -> bytes:
    return chw.permute(1, 2, 0).contiguous().numpy().tobytes()


def write_truth_png(name: str, chw: torch.Tensor) -> dict:
    """A uint8 (3, H, W) truth image as a PNG, with the checksum of its pixels."""
    assert chw.dtype == torch.uint8 and chw.shape[0] == 3
    (OUT / name).write_bytes(encode_png(chw.contiguous(), compression_level=9).numpy().tobytes())
    return {"file": name, "height": int(chw.shape[1]), "width": int(chw.shape[2]), "fnv1a64": fnv1a64(hwc_bytes(chw))}


def pattern(height: int, width: int, seed: int, channels: int = 3, noise: float = 6.0) -> np.ndarray:
    """A photo-like (H, W, C) uint8 image: gradients, a disc, a bar, seeded noise of this deviation."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    planes = [
        255.0 * x / max(width - 1, 1),
        255.0 * y / max(height - 1, 1),
        127.5 + 127.5 * np.sin(x / 3.0 + y / 5.0),
        255.0 * ((x + y) % 7) / 6.0,
    ]
    img = np.stack(planes[:channels], axis=-1)
    disc = (x - width * 0.6) ** 2 + (y - height * 0.4) ** 2 < (min(height, width) * 0.3) ** 2
    img[disc, : min(channels, 3)] = [230.0, 40.0, 60.0][: min(channels, 3)]
    img[(y > height * 0.75) & (x < width * 0.5), 0] = 10.0
    img += rng.normal(0.0, noise, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def chw(hwc: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(hwc)).permute(2, 0, 1).contiguous()


# ---- EXIF orientation containers --------------------------------------------------------------------------
def tiff_orientation(orientation: int, big_endian: bool) -> bytes:
    """A minimal TIFF block: IFD0 with one entry, Orientation (0x0112, SHORT)."""
    e = ">" if big_endian else "<"
    head = (b"MM" if big_endian else b"II") + struct.pack(e + "HI", 42, 8)
    ifd = struct.pack(e + "H", 1) + struct.pack(e + "HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(e + "I", 0)
    return head + ifd


def png_with_exif(png: bytes, orientation: int, big_endian: bool) -> bytes:
    """Inserts an eXIf chunk before the first IDAT (libpng reads it with the header chunks)."""
    payload = tiff_orientation(orientation, big_endian)
    chunk = struct.pack(">I", len(payload)) + b"eXIf" + payload
    chunk += struct.pack(">I", zlib.crc32(b"eXIf" + payload) & 0xFFFFFFFF)
    at = png.index(b"IDAT") - 4
    return png[:at] + chunk + png[at:]


def jpeg_with_exif(jpeg: bytes, orientation: int) -> bytes:
    """Inserts an APP1 Exif segment right after SOI."""
    payload = b"Exif\x00\x00" + tiff_orientation(orientation, big_endian=True)
    segment = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
    assert jpeg[:2] == b"\xff\xd8"
    return jpeg[:2] + segment + jpeg[2:]


# ---- steps ------------------------------------------------------------------------------------------------
def smart_resize_cases() -> list:
    cases = []

    def add(h, w, factor, mn, mx):
        try:
            rh, rw = smart_resize(h, w, factor=factor, min_pixels=mn, max_pixels=mx)
            cases.append({"height": h, "width": w, "factor": factor, "min_pixels": mn, "max_pixels": mx,
                          "resized_height": rh, "resized_width": rw})
        except ValueError as e:
            cases.append({"height": h, "width": w, "factor": factor, "min_pixels": mn, "max_pixels": mx,
                          "error": str(e)})

    qwen3 = (32, 65536, 16777216)           # Qwen3-VL's published budget
    qwen2 = (28, 56 * 56, 28 * 28 * 1280)   # Qwen2-VL's class defaults (patch 14)
    small = (32, 4096, 8192)                # the budget the processor cases below use
    # Python's round() is half-to-even: 48/32 = 1.5 -> 2, 80/32 = 2.5 -> 2, 112/32 = 3.5 -> 4, 16/32 -> 0.
    for h, w in [(1024, 768), (768, 1024), (48, 80), (80, 112), (16, 16), (16, 3200), (1, 200), (200, 1),
                 (1, 201), (201, 1), (3, 700), (4032, 3024), (3024, 4032), (10000, 10000), (1080, 1920),
                 (45, 67), (200, 300), (97, 31), (64, 640), (40, 50), (7, 1400), (1, 1), (2, 2), (33, 33)]:
        for factor, mn, mx in (qwen3, qwen2, small):
            add(h, w, factor, mn, mx)
    rng = np.random.default_rng(2024)
    for _ in range(120):
        h, w = (int(v) for v in rng.integers(1, 6000, 2))
        mn = int(rng.choice([1, 1024, 3136, 4096, 65536, 200704]))
        mx = int(rng.choice([8192, 16384, 262144, 1003520, 16777216]))
        factor = int(rng.choice([28, 32]))
        add(h, w, factor, mn, max(mn, mx))
    return cases


def resize_cases() -> list:
    """Seeded noise through the exact call the processor makes. Inputs are regenerated by the test."""
    cases = []
    shapes = [((45, 67), (64, 96)), ((200, 300), (64, 96)), ((97, 31), (128, 64)), ((64, 640), (32, 256)),
              ((13, 17), (5, 3)), ((7, 7), (64, 64)), ((50, 50), (50, 20)), ((30, 40), (97, 41)),
              ((1, 40), (32, 32)), ((40, 1), (3, 64)), ((33, 257), (32, 32)), ((96, 64), (96, 64))]
    for k, ((h, w), (oh, ow)) in enumerate(shapes):
        seed = 1000 + k
        src = torch.from_numpy(splitmix_bytes(seed, 3 * h * w).reshape(h, w, 3)).permute(2, 0, 1).contiguous()
        out = tvF.resize(src, [oh, ow], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        truth = write_truth_png(f"resize_{k:02d}_{h}x{w}_to_{oh}x{ow}.png", out)
        cases.append({"seed": seed, "height": h, "width": w, "resized": truth,
                      "source_fnv1a64": fnv1a64(hwc_bytes(src))})
    return cases


def processor_cases(processor, decode: dict) -> list:
    """Full preprocessing: a file (decoded by the processor's own loader) or an array, budget (4096, 8192)."""
    budget = {"shortest_edge": 4096, "longest_edge": 8192}
    specs = [
        # name, source file, given to the processor as, keep pixel_values
        ("photo_67x45", "photo_67x45.png", "path", True),
        ("photo_300x200", "photo_300x200.jpg", "path", False),
        ("tall_31x97", "tall_31x97.bmp", "array", False),  # torchvision cannot decode BMP: the array it holds
        ("wide_640x64", "wide_640x64.png", "path", True),
        ("alpha_50x40", "alpha_50x40.png", "path", False),
    ]
    cases = []
    for name, file, given_as, keep_pixels in specs:
        path = str(OUT / file)
        if given_as == "path":
            seen = processor.fetch_images(path)  # the processor's loader: decode_image(RGB, EXIF applied)
            result = processor(images=path, size=budget, return_tensors="pt")
        else:
            seen = chw(np.array(PIL.Image.open(path).convert("RGB")))
            result = processor(images=seen, size=budget, return_tensors="pt")
        seen = seen.contiguous()
        # What the processor saw is what the decode entry of this file records (its truth file when the
        # decoders may differ, JPEG; else the source itself, which kvlite must decode exactly).
        assert fnv1a64(hwc_bytes(seen)) == decode[file]["truth"]["fnv1a64"], name
        grid = [int(v) for v in result["image_grid_thw"][0]]
        pixel_values = result["pixel_values"].float()
        # The resized image from the processor's own resize (smart_resize + tvF.resize), then a check that it
        # is the image pixel_values came from: normalize + patchify it and compare.
        resized = processor.resize(images=seen[None], size=SizeDict(**budget), resample=processor.resample,
                                   factor=processor.patch_size * processor.merge_size)[0]
        again = processor.rescale_and_normalize(resized[None], True, processor.rescale_factor, True,
                                                processor.image_mean, processor.image_std)
        again, gh, gw = processor.patchify(again, processor.patch_size, processor.merge_size,
                                           processor.temporal_patch_size)
        assert [1, gh, gw] == grid and torch.equal(again[0], pixel_values), name
        case = {"name": name, "file": file, "given_as": given_as, "min_pixels": budget["shortest_edge"],
                "max_pixels": budget["longest_edge"], "grid_thw": grid,
                "pixel_values_shape": list(pixel_values.shape), "image_tokens": grid[0] * grid[1] * grid[2] // 4,
                "resized": write_truth_png(f"{name}.resized.png", resized.contiguous())}
        if keep_pixels:
            np.save(OUT / f"{name}.pixel_values.npy", pixel_values.numpy().astype(np.float32))
            case["pixel_values"] = f"{name}.pixel_values.npy"
        cases.append(case)
    return cases


def write_sources() -> tuple:
    """Source images in every format the decoder accepts, and what the reference decoders make of them.
    A lossless decode is recorded by its checksum; a JPEG one (decoders may differ by a few steps) also as
    a truth PNG."""
    decode = {}

    def add(file, reference, pixels, exact, orientation=None):
        truth = (
            {"height": int(pixels.shape[1]), "width": int(pixels.shape[2]), "fnv1a64": fnv1a64(hwc_bytes(pixels))}
            if exact else write_truth_png(f"{file}.truth.png", pixels))
        decode[file] = {"file": file, "reference": reference, "exact": exact, "truth": truth}
        if orientation is not None:
            decode[file]["exif_orientation"] = orientation

    def torchvision_decode(file):  # what the processor's loader does with a path
        data = torch.frombuffer(bytearray((OUT / file).read_bytes()), dtype=torch.uint8)
        return decode_image(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)

    def pil_decode(file):  # the first frame of a GIF
        with PIL.Image.open(OUT / file) as im:
            return chw(np.array(im.convert("RGB")))

    # The processor's images.
    (OUT / "photo_67x45.png").write_bytes(encode_png(chw(pattern(45, 67, 1)), compression_level=9).numpy().tobytes())
    (OUT / "photo_300x200.jpg").write_bytes(
        encode_jpeg(chw(pattern(200, 300, 2, noise=1.5)), quality=90).numpy().tobytes())
    PIL.Image.fromarray(pattern(97, 31, 3)).save(OUT / "tall_31x97.bmp")
    (OUT / "wide_640x64.png").write_bytes(
        encode_png(chw(pattern(64, 640, 4, noise=1.5)), compression_level=9).numpy().tobytes())
    rgba = pattern(40, 50, 5, channels=4)
    rgba[..., 3] = np.clip(rgba[..., 3].astype(int) + np.arange(50)[None, :] * 5 - 100, 0, 255).astype(np.uint8)
    rgba[:3, :, 3] = 0  # fully transparent rows
    rgba[-3:, :, 3] = 255  # opaque rows
    PIL.Image.fromarray(rgba, mode="RGBA").save(OUT / "alpha_50x40.png")  # torchvision writes no alpha
    for file in ("photo_67x45.png", "wide_640x64.png", "alpha_50x40.png"):
        add(file, "torchvision", torchvision_decode(file), exact=True)
    add("photo_300x200.jpg", "torchvision", torchvision_decode("photo_300x200.jpg"), exact=False)
    add("tall_31x97.bmp", "pillow", pil_decode("tall_31x97.bmp"), exact=True)

    # Grayscale PNG: expanded to RGB.
    gray = pattern(19, 23, 6)[..., 0]
    (OUT / "gray_23x19.png").write_bytes(encode_png(torch.from_numpy(gray)[None].contiguous()).numpy().tobytes())
    add("gray_23x19.png", "torchvision", torchvision_decode("gray_23x19.png"), exact=True)
    # GIF with two frames: the first one counts.
    frames = [PIL.Image.fromarray(pattern(21, 29, 7)).quantize(colors=64, dither=PIL.Image.Dither.NONE),
              PIL.Image.fromarray(pattern(21, 29, 8)).quantize(colors=64, dither=PIL.Image.Dither.NONE)]
    frames[0].save(OUT / "anim_29x21.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    add("anim_29x21.gif", "pillow", pil_decode("anim_29x21.gif"), exact=True)
    # TGA (run-length encoded) and binary PPM.
    PIL.Image.fromarray(pattern(15, 27, 9)).save(OUT / "rle_27x15.tga", compression="tga_rle")
    add("rle_27x15.tga", "pillow", pil_decode("rle_27x15.tga"), exact=True)
    PIL.Image.fromarray(pattern(13, 19, 10)).save(OUT / "pnm_19x13.ppm")
    add("pnm_19x13.ppm", "pillow", pil_decode("pnm_19x13.ppm"), exact=True)

    # EXIF orientation 1..8 in PNG eXIf chunks (lossless: exact truth), both byte orders, and one JPEG.
    base = encode_png(chw(pattern(5, 7, 11))).numpy().tobytes()
    for orientation in range(1, 9):
        file = f"orient_{orientation}_7x5.png"
        (OUT / file).write_bytes(png_with_exif(base, orientation, big_endian=orientation % 2 == 0))
        add(file, "torchvision", torchvision_decode(file), exact=True, orientation=orientation)
    jpeg = encode_jpeg(chw(pattern(24, 40, 12)), quality=92).numpy().tobytes()
    (OUT / "orient_6_40x24.jpg").write_bytes(jpeg_with_exif(jpeg, 6))
    add("orient_6_40x24.jpg", "torchvision", torchvision_decode("orient_6_40x24.jpg"), exact=False, orientation=6)

    # JPEG as cameras and editors write it (Pillow's encoder, libjpeg-turbo): every chroma subsampling, odd
    # sizes (partial MCUs), progressive, grayscale and Adobe CMYK. The truth is torchvision's decode, as above.
    photo = pattern(37, 53, 13, noise=2.0)
    for file, options in (("sub444_53x37.jpg", {"subsampling": 0}), ("sub422_53x37.jpg", {"subsampling": 1}),
                          ("sub420_53x37.jpg", {"subsampling": 2}),
                          ("progressive_53x37.jpg", {"subsampling": 2, "progressive": True})):
        PIL.Image.fromarray(photo).save(OUT / file, quality=88, **options)
        add(file, "torchvision", torchvision_decode(file), exact=False)
    PIL.Image.fromarray(photo[..., 1]).save(OUT / "gray_53x37.jpg", quality=88)
    add("gray_53x37.jpg", "torchvision", torchvision_decode("gray_53x37.jpg"), exact=False)
    PIL.Image.fromarray(photo).convert("CMYK").save(OUT / "cmyk_53x37.jpg", quality=88)
    add("cmyk_53x37.jpg", "torchvision", torchvision_decode("cmyk_53x37.jpg"), exact=False)
    return decode, rgba


def composite_case(processor, rgba: np.ndarray) -> dict:
    """An RGBA array handed to the processor: its convert_to_rgb composites onto white, in float32."""
    composited = processor.convert_to_rgb(chw(rgba), input_data_format="channels_first")
    (OUT / "alpha_50x40.rgba").write_bytes(rgba.tobytes())  # the same pixels raw, (40, 50, 4)
    return {"source": "alpha_50x40.png", "raw_rgba": "alpha_50x40.rgba", "height": 40, "width": 50,
            "truth": write_truth_png("alpha_50x40.composited.png", composited)}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():  # start clean, so that no stale output survives a change of this script
        if old.is_file() and old.name != "README.md":
            old.unlink()
    (OUT / "qwen3vl").mkdir(exist_ok=True)
    (OUT / "qwen3vl" / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PREPROCESSOR, indent=2) + "\n")
    processor = AutoImageProcessor.from_pretrained(str(OUT / "qwen3vl"))
    assert type(processor).__name__ == "Qwen2VLImageProcessor" and processor.backend == "torchvision"

    decode, rgba = write_sources()
    cases = {
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "torchvision": torchvision.__version__, "pillow": PIL.__version__, "numpy": np.__version__,
                     "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "processor": {"class": type(processor).__name__, "backend": processor.backend,
                      "preprocessor_config": "qwen3vl/preprocessor_config.json",
                      "rescale_factor": processor.rescale_factor, "image_mean": list(processor.image_mean),
                      "image_std": list(processor.image_std)},
        "smart_resize": smart_resize_cases(),
        "resize": resize_cases(),
        "processor_cases": processor_cases(processor, decode),
        "decode": list(decode.values()),
        "composite": composite_case(processor, rgba),
    }
    (OUT / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {sum(1 for f in OUT.rglob('*') if f.is_file())} files, {total / 1024:.0f} KiB, under {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
