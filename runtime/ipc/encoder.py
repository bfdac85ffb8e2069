"""What a router sends a visual server (runtime/encoder/process.py); the answer is ImagesReady on the
router's results socket (runtime/ipc/messages.py)."""
from __future__ import annotations

from typing import Union

from llaunch.runtime.ipc.messages import ImageRef, _Msg


class EncodeImages(_Msg):
    """Put these images' embeddings in the embed cache (encoding those not there) and pin them there
    for the request; answer ImagesReady."""

    request_id: str
    router: int  # the dp replica to answer
    images: list[ImageRef]  # with pixels


class ReleaseImages(_Msg):
    """These requests ended (and every step that read their embeddings has returned): unpin them."""

    router: int
    request_ids: list[str]


VisualInbound = Union[EncodeImages, ReleaseImages]
