"""A trainer process for the chaos test: runs a 50-step rollout through the SDK's Trajectory,
writing each step's result as it goes. Killed with SIGKILL at random points and restarted."""
import asyncio
import json
import sys

from corral_sdk import AsyncClient


async def main(url: str, tid: str, steps: int, out: str) -> None:
    c = await AsyncClient.connect(url)
    results = []
    async with c.trajectory(tid, image="busybox", cpu=0.1, memory_mb=32, snapshot_every=10, ttl_s=600) as t:
        for i in range(steps):
            if i % 2 == 0:  # non-idempotent: appends
                r = await t.exec(f"mkdir -p /work; echo s{i} >> /work/effects; sleep 0.02; wc -l < /work/effects")
            else:
                r = await t.exec(f"echo step {i}; sleep 0.02")
            results.append({"step": i, "stdout": r.stdout, "exit": r.exit_code, "replayed": r.replayed})
    with open(out, "w") as f:
        json.dump(results, f)
    await c.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
