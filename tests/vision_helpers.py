"""What the vision tests share: a one-colour PNG and a reward that gives every group mixed
scores."""

from __future__ import annotations

import io

from tandem.common.messages.reward import Score


def picture(color, size: tuple[int, int] = (64, 64)) -> bytes:
    """A PNG of `size` pixels, all `color`."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


class ResponseParity:
    """A deterministic reward (response length parity): mixed rewards in every group, so the
    advantages, and the gradients, are not zero. The data path is under test where it is
    used; the vision reward's learning run is tests/e2e's."""

    async def score(self, items):
        return [Score(score=float(len(i.response) % 2)) for i in items]
