"""The frontend's side of images (Qwen2-VL): an `image_url` part's bytes (a `data:` URL, or a file under
visual.allowed_local_media_path; http(s) is never fetched), checked against the visual.* limits and
turned into pixel values and a patch grid by transformers' Qwen2-VL image processor; then each image's
one <|image_pad|> token in the rendered prompt becomes its t·h·w / 4 tokens.

An image's tokens carry the id vocab_size + the low 31 bits of its pixels' hash, not <|image_pad|>:
the prompt cache then shares the KV of a repeated image and never of two different images (the
worker embeds the image at those places). Every failure is a 400 naming the part.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llaunch.runtime.config import ModelConfig, VisualConfig
from llaunch.runtime.web.errors import bad_request
from llaunch.runtime.ipc.messages import ImageRef

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # what Qwen2-VL's template writes per image
DETAILS = (None, "auto", "high")  # `low` would need a smaller resize than the model's processor does: refused


@dataclass(frozen=True)
class ProcessedImage:
    hash: str
    pixels: np.ndarray  # float32 [t·h·w, C·T·P·P]
    grid: tuple[int, int, int]


class ImageInputs:
    """Reads, checks and preprocesses a request's images (one per frontend process)."""

    def __init__(self, model: ModelConfig, visual: VisualConfig):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.visual = visual
        self.vocab_size = model.vocab_size
        self.image_token_id = int(model.vision["image_token_id"])
        self.vision_start_id = int(model.vision.get("vision_start_token_id", 151652))  # Qwen2-VL's ids
        self.vision_end_id = int(model.vision.get("vision_end_token_id", 151653))
        self.merge = int(model.vision.get("spatial_merge_size", 2))
        processor_dir = model.path if model.path and os.path.isfile(
            os.path.join(model.path, "preprocessor_config.json")) else None
        # a checkpoint's own preprocessor_config.json (min/max pixels, mean/std); else Qwen2-VL's defaults
        self.processor = (Qwen2VLImageProcessorPil.from_pretrained(processor_dir) if processor_dir
                          else Qwen2VLImageProcessorPil(patch_size=int(model.vision.get("patch_size", 14)),
                                                        merge_size=self.merge))

    def read(self, url: str, param: str) -> bytes:
        """The encoded image an image_url names."""
        limit = self.visual.max_image_bytes
        if url.startswith("data:"):
            header, _, payload = url.partition(",")
            if ";base64" not in header:
                raise bad_request("An image data: URL must be base64 (data:image/...;base64,...).", param=param)
            return self.decode_base64(payload, param)
        if url.startswith(("http://", "https://")):
            raise bad_request("Image URLs are not fetched: send the image as a data: URL.", param=param)
        path = url.removeprefix("file://")
        root = self.visual.allowed_local_media_path
        if root is None or not os.path.isabs(path):
            raise bad_request("Local image files are refused (visual.allowed_local_media_path is unset); send a "
                              "data: URL.", param=param)
        real, root_real = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, root_real]) != root_real or not os.path.isfile(real):
            raise bad_request("The image file is not under visual.allowed_local_media_path.", param=param)
        if os.path.getsize(real) > limit:
            raise bad_request(f"The image is larger than visual.max_image_bytes={limit}.", param=param)
        with open(real, "rb") as f:
            return f.read()

    def decode_base64(self, payload: str, param: str) -> bytes:
        """An image sent as base64 (a data: URL's payload, LightLLM's {"type": "base64"})."""
        limit = self.visual.max_image_bytes
        if len(payload) * 3 // 4 > limit:
            raise bad_request(f"The image is larger than visual.max_image_bytes={limit}.", param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("The image is not valid base64.", param=param) from None

    def process(self, data: bytes, param: str) -> ProcessedImage:
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > self.visual.max_image_pixels:
                raise bad_request(f"The image has {image.width}x{image.height} pixels, more than "
                                  f"visual.max_image_pixels={self.visual.max_image_pixels}.", param=param)
            image.load()
            out = self.processor(images=[image.convert("RGB")], return_tensors="np")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise bad_request(f"The image cannot be read: {e}", param=param) from None
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return ProcessedImage(hashlib.sha256(pixels.tobytes() + bytes(str(grid), "ascii")).hexdigest(), pixels, grid)

    def token_id(self, image: ProcessedImage) -> int:
        return self.vocab_size + int(image.hash[:8], 16) % 2**31

    def splice(self, prompt_ids: list[int], images: list[ProcessedImage],
               param: str = "messages") -> tuple[list[int], list[ImageRef]]:
        """The prompt with each <|image_pad|> grown into its image's tokens, and the images' refs."""
        places = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(places) != len(images):
            raise bad_request(f"The prompt holds {len(places)} image placeholders for {len(images)} images "
                              f"(is {IMAGE_PLACEHOLDER} in the text?).", param=param)
        out, refs, last = [], [], 0
        for place, image in zip(places, images):
            out.extend(prompt_ids[last:place])
            t, h, w = image.grid
            refs.append(ImageRef(hash=image.hash, offset=len(out), grid=[t, h, w], pixels=image.pixels.tobytes()))
            out.extend([self.token_id(image)] * (t * h * w // self.merge ** 2))
            last = place + 1
        out.extend(prompt_ids[last:])
        return out, refs


def image_url_of(part, param: str) -> Optional[str]:
    """The URL of an image_url content part (None for other parts); `detail` must be auto or high."""
    if part.type != "image_url":
        return None
    if part.image_url is None or not part.image_url.url:
        raise bad_request("An image_url part needs image_url.url.", param=param)
    if part.image_url.detail not in DETAILS:
        raise bad_request(f"image_url.detail={part.image_url.detail!r} is not supported (auto, high).",
                          param=f"{param}.image_url.detail")
    return part.image_url.url


def chat_images(inputs: Optional[ImageInputs], req, prompt_ids: list[int], urls: Optional[list]
                ) -> tuple[list[int], list[ImageRef]]:
    """A chat request's prompt with its images spliced in (unchanged without images)."""
    if not urls:
        return prompt_ids, []
    check_image_count(inputs, len(urls), "messages")
    if req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported with images.", param="prompt_logprobs")
    images = [inputs.process(inputs.read(url, param), param) for url, param in urls]
    return inputs.splice(prompt_ids, images)


def check_image_count(inputs: ImageInputs, n: int, param: str) -> None:
    if n > inputs.visual.max_images_per_request:
        raise bad_request(f"{n} images: more than visual.max_images_per_request="
                          f"{inputs.visual.max_images_per_request}.", param=param)
