"""端到端延迟 = TTFT + (N − 1) × TPOT：单个请求，提示词 P 个 token、生成 N 个。量出每个 P 的 TTFT（一次 prefill
前向）和 TPOT（上下文 ≈ P 时一步 decode 的中位数），再在 P × N 的网格上算 TTFT 占端到端的比例，看它在哪里占大头。

    python step07_chunked_prefill/analysis/ttft_tpot.py [--prompt-lens 16,64,256] [--output-lens 1,8,64,256] [--model 目录]

网格里只有 TTFT 和 TPOT 是量的（每个 P 量 --repeats 次取中位数）；端到端那几列是按上面的式子算的，不是每格都
跑一遍（TPOT 随上下文缓慢增长，N 大时式子略低估）。单请求、批大小 1，没有排队：TTFT 只是 prefill 本身。
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from common.bench import machine, table  # noqa: E402
from common.prompts import LONG_PROMPT  # noqa: E402
from step03_kvcache_single.cache import PreallocKVCache  # noqa: E402
from step03_kvcache_single.engine import forward  # noqa: E402


@torch.inference_mode()
def ttft_tpot(model, cfg, ids: list[int], decode_steps: int, repeats: int) -> tuple[float, float]:
    """(TTFT 秒, TPOT 秒)：prefill 整段 ids 的时间（repeats 次的中位数）、之后 decode_steps 步每步时间的中位数。"""
    prefill, decode = [], []
    for _ in range(repeats):
        cache = PreallocKVCache(cfg, len(ids) + decode_steps, model.device, next(model.parameters()).dtype)
        t = time.perf_counter()
        logits = forward(model, cache, ids, 0)
        tok = int(logits.argmax())
        prefill.append(time.perf_counter() - t)
        for _ in range(decode_steps):
            t = time.perf_counter()
            tok = int(forward(model, cache, [tok], cache.length).argmax())
            decode.append(time.perf_counter() - t)
    return statistics.median(prefill), statistics.median(decode)


def grid(measured: dict[int, tuple[float, float]], output_lens: list[int]) -> list[list]:
    """每个 P 一行：TTFT、TPOT、TTFT = (N−1)·TPOT 的那个 N，以及每个 N 下 TTFT 占端到端的百分比。"""
    rows = []
    for p, (ttft, tpot) in measured.items():
        shares = [f"{100 * ttft / (ttft + (n - 1) * tpot):.0f}%" for n in output_lens]
        rows.append([p, f"{ttft * 1e3:.0f}", f"{tpot * 1e3:.1f}", f"{1 + ttft / tpot:.1f}", *shares])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-lens", default="16,64,256")
    ap.add_argument("--output-lens", default="1,8,64,256")
    ap.add_argument("--decode-steps", type=int, default=4, help="每个 P 量几步 decode")
    ap.add_argument("--repeats", type=int, default=1, help="每个 P 量几轮，取中位数")
    ap.add_argument("--model", help="模型目录（默认：默认模型）")
    args = ap.parse_args()
    from common.cli import open_session
    s = open_session(args.model, "cpu", "float32")
    text = s.tok.encode(LONG_PROMPT)
    prompt_lens, output_lens = [int(x) for x in args.prompt_lens.split(",")], [int(x) for x in args.output_lens.split(",")]
    if max(prompt_lens) > len(text):
        sys.exit(f"error: --prompt-lens at most {len(text)} (LONG_PROMPT's length)")
    print(f"机器: {machine()}；模型 {s.path.name}，cpu/float32，批大小 1")
    measured = {p: ttft_tpot(s.model, s.cfg, text[:p], args.decode_steps, args.repeats) for p in prompt_lens}
    print(table(["P", "TTFT (ms)", "TPOT (ms)", "N*（TTFT = (N*−1)·TPOT）",
                 *[f"N={n}：TTFT 占" for n in output_lens]], grid(measured, output_lens)))


if __name__ == "__main__":
    main()
