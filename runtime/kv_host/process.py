"""The kv_host process: owns the host KV tier's shared memory for the workers of its node (one file
per worker, runtime/cache/host_pool.py) for the whole run, and removes it at exit. Workers map their
file; a worker restarted within the run maps the same one. It does nothing else, so it stays up as
long as the graph does (the launcher tears the graph down if it dies, and removes the files)."""
from __future__ import annotations

import logging
import time

import zmq

from llaunch.runtime.bootstrap import StopFlag, report_ready, start
from llaunch.runtime.cache.host_index import index_bytes
from llaunch.runtime.cache.host_pool import create_pool, pool_bytes, remove_pool

log = logging.getLogger(__name__)


def pool_paths(spec) -> list[str]:
    return [path for key, path in sorted(spec.binds.items()) if key.startswith("pool.")]


def index_paths(spec) -> list[str]:
    """cache.dp_fetch: a host-wide index file per dp replica (runtime/cache/host_index.py)."""
    return [path for key, path in sorted(spec.binds.items()) if key.startswith("index.")]


def main() -> None:
    cfg, spec = start()
    size = pool_bytes(cfg)
    paths = pool_paths(spec)
    indexes = index_paths(spec)
    stop = StopFlag().install()
    try:
        for i, path in enumerate(paths):
            create_pool(path, size, others=i * size)  # sparse until written: count the earlier ones
        for path in indexes:  # zeros: nothing published, nothing pinned
            create_pool(path, index_bytes(cfg.cache.cpu_tokens, cfg.parallel.dp), others=len(paths) * size)
        ctx = zmq.Context()
        report_ready(ctx, cfg, spec, pools=len(paths), slots=cfg.cache.cpu_tokens, gib=f"{size * len(paths) / 2**30:.2f}")
        log.info("host KV tier: %d pool(s) of %d slots, %.2f GiB each", len(paths), cfg.cache.cpu_tokens, size / 2**30)
        while not stop.requested:
            time.sleep(0.2)
        ctx.term()
    except KeyboardInterrupt:
        pass
    finally:
        for path in paths + indexes:
            remove_pool(path)


if __name__ == "__main__":
    main()
