"""The host KV tier under the decode CUDA graphs: the CPU test's conversations (tiny random Qwen2,
float32), with the pool file registered with CUDA and its copies on the side stream, while decode
steps replay graphs. Every turn evicts through both tiers; greedy tokens and every cached node's KV
must equal a never-evicting prompt cache's."""
from __future__ import annotations

import os
import uuid

import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from integration.test_host_tier import same_tokens_with_eviction_through_both_tiers
from llaunch.runtime.cache.host_pool import SHM_DIR, remove_pool
from llaunch.runtime.models.loader import build_model


def test_demote_and_promote_between_graph_replays_keep_tokens_and_kv(tmp_path):
    model = build_model(model_config_from_folder(write_tiny_checkpoint(tmp_path, "qwen2")), device=torch.device("cuda"),
                        dtype=torch.float32)
    path = os.path.join(SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp", f"llaunch-kv-test-{uuid.uuid4().hex}")
    try:
        tiered = same_tokens_with_eviction_through_both_tiers(model, path, cuda_graphs=True)
        assert tiered.runner.graphs.replays > 0, "no decode step replayed a graph"
    finally:
        remove_pool(path)
