"""Images on LightLLM's /generate (Qwen2-VL): `multimodal_params: {"images": [{"type": "base64" | "url",
"data": ...}]}` (lightllm/server/multimodal_params.py), read and checked by the chat path's code
(runtime/http/images.py: the same visual.* limits, data: URLs and files under
visual.allowed_local_media_path only). The prompt places the images as LightLLM's Qwen2-VL tokenizer
reads them: each <|vision_start|> directly followed by <|vision_end|> once the <|image_pad|> tokens are
dropped (`<|vision_start|><|image_pad|><|vision_end|>` or `<|vision_start|><|vision_end|>`) holds the
next image, whose t·h·w/4 tokens then stand between the two."""
from __future__ import annotations

from typing import Any, Optional

import msgspec

from llaunch.runtime.web.errors import bad_request
from llaunch.runtime.http.images import ImageInputs, check_image_count
from llaunch.runtime.ipc.messages import ImageRef


class ImageItem(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # base64 | url (LightLLM's image_size, for token counting only, is refused)
    data: Any


class MultimodalParams(msgspec.Struct, forbid_unknown_fields=True):
    images: list[ImageItem] = []


def lightllm_placeholders(prompt_ids: list[int], inputs: ImageInputs) -> list[int]:
    """The prompt with <|image_pad|> dropped and one put into each <|vision_start|><|vision_end|> pair:
    where LightLLM's QWen2VLTokenizer.encode puts an image, in the form ImageInputs.splice expands."""
    pad, start, end = inputs.image_token_id, inputs.vision_start_id, inputs.vision_end_id
    ids = [t for t in prompt_ids if t != pad]
    out = []
    for i, t in enumerate(ids):
        out.append(t)
        if t == start and i + 1 < len(ids) and ids[i + 1] == end:
            out.append(pad)
    return out


def _image_bytes(inputs: ImageInputs, item: ImageItem, param: str) -> bytes:
    if item.type not in ("base64", "url"):
        raise bad_request(f"Image type {item.type!r} is not supported: send \"base64\" or \"url\".",
                          param=f"{param}.type")
    if not isinstance(item.data, str) or not item.data:
        raise bad_request(f"An image's data must be a non-empty string (type {item.type!r}).", param=f"{param}.data")
    if item.type == "base64":
        return inputs.decode_base64(item.data, f"{param}.data")
    return inputs.read(item.data, f"{param}.data")  # the chat path's image_url rules: data:, allowed files, no http


def generate_images(inputs: Optional[ImageInputs], params: Optional[MultimodalParams],
                    prompt_ids: list[int]) -> tuple[list[int], list[ImageRef]]:
    """A /generate prompt with its images spliced in (unchanged, and no refs, without images)."""
    if params is None or not params.images:
        return prompt_ids, []
    if inputs is None:
        raise bad_request("multimodal_params.images: this server's model takes no images.",
                          param="multimodal_params.images")
    check_image_count(inputs, len(params.images), "multimodal_params.images")
    images = [inputs.process(_image_bytes(inputs, item, f"multimodal_params.images[{i}]"),
                             f"multimodal_params.images[{i}]") for i, item in enumerate(params.images)]
    return inputs.splice(lightllm_placeholders(prompt_ids, inputs), images, param="inputs")
