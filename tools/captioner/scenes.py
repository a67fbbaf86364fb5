"""Generated scenes and their exact captions, shared by tools/train_captioner.py and tools/eval_captioner.py.

A scene is one to three shapes on a 128 x 128 background. Its caption follows a fixed grammar, so that one
picture has exactly one correct caption:

    1 shape    "a large red circle"
    2 shapes   "a small blue star to the left of a large white square"   (the left one first)
               "a large green triangle above a small purple circle"       (the upper one first)
    3 shapes   "a small red square, a large yellow star and a small black circle, from left to right"

Every shape is described as "a <size> <colour> <shape>". Sizes are two well separated ranges of radii.
Two shapes are related by the axis along which they are further apart ("to the left of" or "above"); three are
listed left to right. Scenes where that reading would be unclear are rejected while sampling: two shapes whose
horizontal and vertical distances are within a factor of 1.5 of each other, three shapes whose centres are
closer than MIN_ROW_GAP horizontally, and shapes that overlap or touch.

Drawing is deterministic (Pillow at 4x, box-filtered down): the same seed gives the same pixels.
"""

import math
import random
from dataclasses import dataclass

import numpy as np
import PIL.Image
import PIL.ImageDraw

SIDE = 128  # image side in pixels: 8 x 8 patches of 16, 4 x 4 = 16 image tokens after the 2 x 2 merge
SUPERSAMPLE = 4

SHAPES = ("circle", "square", "triangle", "star")
COLOURS = {
    "red": (220, 40, 40),
    "orange": (245, 140, 20),
    "yellow": (240, 215, 30),
    "green": (40, 160, 60),
    "blue": (40, 80, 225),
    "purple": (145, 55, 185),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
# Radii (pixels) that set each shape's size (the circle's radius; the others are drawn to look about as big);
# the two ranges are a factor of ~1.5 apart (areas more than 2x).
SIZES = {"small": (10.5, 13.5), "large": (20.0, 25.0)}

COUNT_WEIGHTS = {1: 0.25, 2: 0.40, 3: 0.35}
AXIS_RATIO = 1.5   # two shapes: the larger of |dx|, |dy| must be at least this times the smaller
MIN_ROW_GAP = 14.0  # three shapes: horizontal distance between neighbouring centres, pixels
CLEARANCE = 4.0     # gap between the circles that hold two shapes, pixels
BORDER = 3.0        # gap between a shape's circle and the image edge, pixels
COLOUR_JITTER = 12  # each channel of a shape's colour moves by up to this much
SQUARE_HALF_SIDE = 0.92  # x radius
# How far each shape reaches from its centre, x radius (the square's corners, the triangle's and star's tips).
REACH = {"circle": 1.0, "square": SQUARE_HALF_SIDE * math.sqrt(2), "triangle": 1.1, "star": 1.1}


@dataclass(frozen=True)
class Shape:
    kind: str     # one of SHAPES
    colour: str   # one of COLOURS
    size: str     # one of SIZES
    x: float      # centre, pixels from the left edge
    y: float      # centre, pixels from the top edge
    radius: float
    rgb: tuple    # the drawn colour (COLOURS[colour] with jitter)

    def phrase(self):
        return f"a {self.size} {self.colour} {self.kind}"


@dataclass(frozen=True)
class Scene:
    shapes: tuple       # Shape, in caption order
    background: dict    # how the background is drawn (see draw_background)
    caption: str


# ---------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------

def _sample_background(rng):
    def muted():
        grey = rng.uniform(100, 160)
        return tuple(grey + rng.uniform(-15, 15) for _ in range(3))

    style = rng.choices(("plain", "gradient", "noise"), weights=(0.5, 0.3, 0.2))[0]
    background = {"style": style, "colour": muted()}
    if style == "gradient":
        background["colour2"] = muted()
        background["angle"] = rng.uniform(0, 2 * math.pi)
    if style == "noise":
        background["sigma"] = rng.uniform(3, 8)
        background["noise_seed"] = rng.randrange(2 ** 31)
    return background


def _sample_shape(rng):
    size = rng.choice(tuple(SIZES))
    radius = rng.uniform(*SIZES[size])
    colour = rng.choice(tuple(COLOURS))
    rgb = tuple(min(255, max(0, c + rng.randint(-COLOUR_JITTER, COLOUR_JITTER))) for c in COLOURS[colour])
    kind = rng.choice(SHAPES)
    reach = REACH[kind] * radius
    lo, hi = reach + BORDER, SIDE - reach - BORDER
    return Shape(kind=kind, colour=colour, size=size, x=rng.uniform(lo, hi), y=rng.uniform(lo, hi),
                 radius=radius, rgb=rgb)


def _clear_of(shape, others):
    return all(math.hypot(shape.x - o.x, shape.y - o.y) >= REACH[shape.kind] * shape.radius
               + REACH[o.kind] * o.radius + CLEARANCE for o in others)


def _caption(shapes):
    """(shapes in caption order, caption), or None when the scene's reading would be unclear."""
    if len(shapes) == 1:
        return shapes, shapes[0].phrase()
    if len(shapes) == 2:
        a, b = shapes
        dx, dy = abs(a.x - b.x), abs(a.y - b.y)
        if dx >= AXIS_RATIO * dy:
            first, second = sorted(shapes, key=lambda s: s.x)
            return (first, second), f"{first.phrase()} to the left of {second.phrase()}"
        if dy >= AXIS_RATIO * dx:
            first, second = sorted(shapes, key=lambda s: s.y)
            return (first, second), f"{first.phrase()} above {second.phrase()}"
        return None
    ordered = tuple(sorted(shapes, key=lambda s: s.x))
    if any(right.x - left.x < MIN_ROW_GAP for left, right in zip(ordered, ordered[1:])):
        return None
    first, second, third = ordered
    return ordered, f"{first.phrase()}, {second.phrase()} and {third.phrase()}, from left to right"


def sample_scene(rng):
    """One scene from `rng` (a random.Random); rejected draws consume the generator, so a seed fixes all.

    Shapes are placed one by one, each redrawn until it is clear of the ones before; a layout whose caption
    would be unclear is drawn again from the first shape."""
    count = rng.choices(tuple(COUNT_WEIGHTS), weights=tuple(COUNT_WEIGHTS.values()))[0]
    background = _sample_background(rng)
    while True:
        shapes = []
        while len(shapes) < count:
            shape = _sample_shape(rng)
            if _clear_of(shape, shapes):
                shapes.append(shape)
        described = _caption(tuple(shapes))
        if described is not None:
            ordered, caption = described
            return Scene(shapes=ordered, background=background, caption=caption)


def scenes(seed, n):
    """The first n scenes of the stream `seed`."""
    rng = random.Random(seed)
    return [sample_scene(rng) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------------------

def _polygon(kind, x, y, r):
    if kind == "square":
        h = SQUARE_HALF_SIDE * r
        return [(x - h, y - h), (x + h, y - h), (x + h, y + h), (x - h, y + h)]
    if kind == "triangle":  # pointing up, its circumcentre lowered so that it sits in the circle's box
        c = 1.1 * r
        return [(x + c * math.cos(math.radians(a)), y + 0.15 * r - c * math.sin(math.radians(a)))
                for a in (90, 210, 330)]
    if kind == "star":  # five points, pointing up
        outer, inner = 1.1 * r, 0.45 * r
        return [(x + (outer if k % 2 == 0 else inner) * math.sin(math.pi * k / 5),
                 y - (outer if k % 2 == 0 else inner) * math.cos(math.pi * k / 5)) for k in range(10)]
    raise ValueError(kind)


def draw_background(background):
    """float32 [SIDE, SIDE, 3] in 0..255."""
    base = np.array(background["colour"], dtype=np.float32)
    pixels = np.empty((SIDE, SIDE, 3), dtype=np.float32)
    pixels[...] = base
    if background["style"] == "gradient":
        ys, xs = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32) / (SIDE - 1) - 0.5
        t = xs * math.cos(background["angle"]) + ys * math.sin(background["angle"])
        t = (t - t.min()) / (t.max() - t.min())
        pixels = base + t[..., None] * (np.array(background["colour2"], dtype=np.float32) - base)
    elif background["style"] == "noise":
        noise = np.random.default_rng(background["noise_seed"]).normal(0, background["sigma"], (SIDE, SIDE, 3))
        pixels = pixels + noise.astype(np.float32)
    return pixels


def render(scene):
    """The scene as an RGB PIL image of SIDE x SIDE: each shape's coverage (drawn at SUPERSAMPLE x inside its
    bounding box and box-filtered down) blends its colour over what is below."""
    s = SUPERSAMPLE
    pixels = draw_background(scene.background)
    for shape in scene.shapes:
        reach = REACH[shape.kind] * shape.radius + 1
        x0, y0 = max(0, int(shape.x - reach)), max(0, int(shape.y - reach))
        x1, y1 = min(SIDE, int(math.ceil(shape.x + reach))), min(SIDE, int(math.ceil(shape.y + reach)))
        mask = PIL.Image.new("L", ((x1 - x0) * s, (y1 - y0) * s), 0)
        draw = PIL.ImageDraw.Draw(mask)
        x, y, r = (shape.x - x0) * s, (shape.y - y0) * s, shape.radius * s
        if shape.kind == "circle":
            draw.ellipse([x - r, y - r, x + r, y + r], fill=255)
        else:
            draw.polygon(_polygon(shape.kind, x, y, r), fill=255)
        coverage = np.asarray(mask.resize((x1 - x0, y1 - y0), PIL.Image.Resampling.BOX), dtype=np.float32)
        coverage = coverage[..., None] / 255
        region = pixels[y0:y1, x0:x1]
        pixels[y0:y1, x0:x1] = region * (1 - coverage) + np.array(shape.rgb, dtype=np.float32) * coverage
    return PIL.Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB")
