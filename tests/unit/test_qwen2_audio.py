"""Qwen2-Audio on the worker's runner (audio tower in-process, clip embeddings spliced in) against
transformers' generate on a tiny random checkpoint: greedy tokens identical with 0, 1 and 2 clips of
different lengths, the prompt prefilled in chunks that cut through a clip; each clip's embeddings equal
transformers'; a repeated clip is not encoded again, a different one changes the output."""
from dataclasses import replace

import pytest
import torch

from llaunch.runtime.encoder.in_process import InProcessAudioEmbeds
from llaunch.runtime.http.audio_features import AudioFeatures
from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.loader import build_audio_tower, build_model
from llaunch.runtime.worker.audio_rows import AudioRows
from llaunch.runtime.worker.runner import ModelRunner
from tests.fixtures.tiny_audio import AudioOracle, clip, write_tiny_qwen2_audio
from tests.fixtures.tiny_models import model_config_from_folder


MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio"))
    ckpt = read_checkpoint(str(path))
    assert ckpt.family == "qwen2" and ckpt.arch.get("vision") is None
    cfg = replace(model_config_from_folder(path), audio=ckpt.arch["audio"])
    model = build_model(cfg, torch.device("cpu"), torch.float32)
    clips = InProcessAudioEmbeds(build_audio_tower(cfg, torch.device("cpu"), torch.float32), 2**20)
    runner = ModelRunner(model, model.make_kv_cache(512, 5, 512), 4, torch.device("cpu"), images=AudioRows(clips))
    return AudioOracle(path), AudioFeatures(cfg.audio, cfg.vocab_size, str(path)), runner, clips


def generate(runner, prompt, refs, row, chunk=17) -> tuple[list[int], list[float]]:
    """Greedy tokens of one request and their logprobs: its prompt in chunks of `chunk` tokens (cutting
    through clips), then decode steps."""
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, logprobs=True)
    slots = list(range(row * 120 + 1, row * 120 + 1 + len(prompt) + MAX_NEW))
    new = [NewSeq(row=row, request_id=f"r{row}", sampling=greedy, prompt_ids=prompt, images=refs)]
    tokens, logprobs, step = [], [], 0
    for start in range(0, len(prompt), chunk):
        ids = prompt[start:start + chunk]
        result = runner.execute(StepPlan(step=step, new=new, prefill=[PrefillChunk(
            row=row, token_ids=ids, start=start, slots=slots[start:start + len(ids)],
            sample=start + len(ids) == len(prompt))]))
        new, step = [], step + 1
    while True:
        tokens += result.token_ids
        logprobs += result.logprobs
        if len(tokens) == MAX_NEW:
            return tokens, logprobs
        result = runner.execute(StepPlan(step=step, decode_rows=[row],
                                         decode_slots=[slots[len(prompt) + len(tokens) - 1]]))
        step += 1


def messages_with(n: int) -> list[dict]:
    parts = [{"type": "input_audio", "input_audio": {"data": "-", "format": "wav"}} for _ in range(n)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is said?"}]}]


@pytest.mark.parametrize("seconds", [[], [1.3], [0.7, 2.1]], ids=["0-clips", "1-clip", "2-clips"])
def test_greedy_matches_transformers(setup, seconds):
    oracle, features, runner, clips = setup
    waves = [clip(s, seed) for seed, s in enumerate(seconds)]
    messages = messages_with(len(waves))
    expected, prompt_len, expected_logprobs = oracle.greedy(messages, waves, MAX_NEW)
    prompt, refs = features.splice(oracle.prompt_ids(messages), [features.process(w) for w in waves])
    assert len(prompt) == prompt_len
    tokens, logprobs = generate(runner, prompt, refs, len(seconds))
    assert tokens == expected
    # the logprobs too: a clip spliced at the wrong tokens could keep a random model's greedy tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=2e-3)
    if len(seconds) == 2:
        assert refs[0].grid != refs[1].grid and clips.encoded >= 2


def test_tower_matches_transformers(setup):
    """Each clip's embeddings (ours: only the frames it reads, clips of different lengths in one batch
    with masked keys) equal transformers' (every clip padded to 30 s)."""
    oracle, features, runner, clips = setup
    waves = [clip(0.45, 3), clip(2.6, 4), clip(31.0, 5)]  # past 30 s: cut, as transformers does
    ours = clips.embeddings(features.splice(
        [features.audio_token_id] * 3, [features.process(w) for w in waves])[1])
    for mine, theirs in zip(ours, oracle.embeddings(waves), strict=True):
        assert mine.shape == theirs.shape
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_repeated_clip_is_not_encoded_again(setup):
    oracle, features, runner, clips = setup
    prompt, refs = features.splice(oracle.prompt_ids(messages_with(1)), [features.process(clip(1.0, 7))])
    before, hits = clips.encoded, clips.cache.hits
    first = generate(runner, prompt, refs, 3)
    second = generate(runner, prompt, refs, 3)
    assert first == second
    assert clips.encoded == before + 1 and clips.cache.hits == hits + 1
    other, refs = features.splice(oracle.prompt_ids(messages_with(1)), [features.process(clip(1.0, 8))])
    assert generate(runner, other, refs, 3)[1] != pytest.approx(first[1], abs=2e-3)  # the clip matters
