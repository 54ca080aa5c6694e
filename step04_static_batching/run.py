"""step04_static_batching：静态批处理 —— 先证明每个请求在批里的输出与 step03 单独生成逐 token 一致，再测三种浪费和吞吐。

    python step04_static_batching/run.py [--quick] [--json] [--max-batch-size 8]          # 章节模式：检查 + 基准
    python step04_static_batching/run.py --prompt "A" --prompt "B" --max-new-tokens 16 \\
        [--max-batch-size 8] [--temperature 0.8 --seed 1 ...] [--stop "."]               # 生成模式：所有提示词一起跑
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common import cli  # noqa: E402
from common.bench import (Roofline, machine, matmul_flops, median_time, memory_bandwidth, table,  # noqa: E402
                          weight_bytes_per_step)
from common.compare import MARGIN_TOL, compare  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.model import Linear  # noqa: E402
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT  # noqa: E402
from step02_sampling.sampler import SamplingParams, add_sampling_args, draw_margin, params_from_args  # noqa: E402
from step03_kvcache_single.cache import PreallocKVCache  # noqa: E402
from step03_kvcache_single.engine import generate as generate_step03  # noqa: E402
from step04_static_batching.engine import forward, generate_batch  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402

STEP = "step04_static_batching"
SEEDED = dict(temperature=0.8, top_p=0.95)   # 带种子采样的检查：每个请求一个自己的种子 100 + i
SEED_BASE = 100


def chapter_workload(s: cli.Session) -> list[tuple[str, list[int], int]]:
    """(名字, 提示词 ids, max_new_tokens)，按"到达顺序"排列：提示词约 5 到 500 个 token，
    新 token 上限各不相同；两条对话提示词通常几个 token 后就以 EOS 自然结束。
    长提示词取 LONG_PROMPT 的前 n 个 token。"""
    prompts = {name: (text, chat) for name, text, chat in CHAPTER_PROMPTS}
    long_ids = s.tok.encode(LONG_PROMPT)
    return [
        ("english", s.encode(*prompts["english"]), 32),
        ("long_500", long_ids[:500], 16),
        ("chat", s.encode(*prompts["chat"]), 48),
        ("chinese", s.encode(*prompts["chinese"]), 24),
        ("long_250", long_ids[:250], 8),
        ("chat_yes_no", s.encode("Reply with one word: yes or no?", chat=True), 32),
        ("code", s.encode(*prompts["code"]), 40),
        ("long_120", long_ids[:120], 24),
    ]


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t


def run_step03(s: cli.Session, requests: list[Request]) -> list[list[int]]:
    """基线：step03 一个一个地单独生成。"""
    return [generate_step03(s.model, r.prompt_ids, r.max_new_tokens, r.params, s.tok.eos_ids, r.ignore_eos)
            for r in requests]


def compare_all(s: cli.Session, label: str, names, requests, refs, outputs, checks: dict, notes: list) -> None:
    tol = MARGIN_TOL[s.dtype]
    for name, r, ref, got in zip(names, requests, refs, outputs):
        c = compare(f"{label}/{name}", r.prompt_ids, ref, got, s.full_logits, tol, draw_margin(r.params))
        checks[f"{label}_{name}"] = c.ok
        notes.append(c.describe())


def check_workload(args, s: cli.Session, checks: dict, notes: list) -> dict:
    """混合负载：贪心与带种子采样各跑一遍（step03 逐个 vs step04 一批），再单独跑每个请求证明填充不改变输出。"""
    workload = chapter_workload(s)
    names = [name for name, _, _ in workload]
    greedy = [Request(ids, n, SamplingParams()) for _, ids, n in workload]
    seeded = [Request(ids, n, SamplingParams(**SEEDED, seed=SEED_BASE + i)) for i, (_, ids, n) in enumerate(workload)]
    B = args.max_batch_size

    run_step03(s, [Request(greedy[0].prompt_ids, 2)])       # 预热：别让第一次前向的一次性开销算进 step03 的计时
    # (a) 贪心：每个请求在批里的输出 = step03 单独生成的输出
    refs, t_seq = timed(lambda: run_step03(s, greedy))
    (outputs, stats), t_batch = timed(lambda: generate_batch(s.model, greedy, B, s.tok.eos_ids))
    compare_all(s, "greedy_equals_step03", names, greedy, refs, outputs, checks, notes)
    # (b) 带种子采样：每个请求自己的发生器，与 step03 单独生成消耗同一串随机数
    seeded_refs = run_step03(s, seeded)
    seeded_out, _ = generate_batch(s.model, seeded, B, s.tok.eos_ids)
    compare_all(s, "seeded_equals_step03", names, seeded, seeded_refs, seeded_out, checks, notes)
    # (c) 填充不改变输出：同一个请求单独成批（没有填充）与在批里（被左填充到最长）给出相同的 token
    alone, _ = generate_batch(s.model, greedy, 1, s.tok.eos_ids)
    compare_all(s, "alone_equals_in_batch", names, greedy, alone, outputs, checks, notes)

    rows = []
    for i, (name, r, out) in enumerate(zip(names, greedy, outputs)):
        group = range(i - i % B, min(i - i % B + B, len(greedy)))            # 它所在的那一批
        P = max(len(greedy[j].prompt_ids) for j in group)
        longest = max(len(outputs[j]) for j in group)
        ended = "EOS" if out[-1] in s.tok.eos_ids else "长度"
        rows.append([name, len(r.prompt_ids), P - len(r.prompt_ids), r.max_new_tokens, len(out), ended,
                     longest - len(out), repr(s.tok.decode(out)[:40])])
    print(f"混合负载（{len(greedy)} 个请求，--max-batch-size {B}，贪心）：")
    print(table(["请求", "提示词", "左填充", "max_new", "生成", "结束于", "陪跑步数", "输出开头"], rows))

    kv_bytes = s.cfg.kv_bytes_per_token(s.dtype.itemsize)
    mib = lambda slots: f"{slots * kv_bytes / 2**20:.1f} MiB"  # noqa: E731
    wasted_kv = stats.kv_slot_steps_held - stats.kv_slot_steps_used
    print(f"\n三种浪费（上面的混合负载，{stats.prefill_steps} 批，{stats.num_forwards} 次前向；KV 每 token "
          f"{kv_bytes / 1024:.1f} KiB；KV 浪费按每次前向之后的槽数累加，与第 05 章同一个定义）:")
    print(table(["浪费", "浪费掉的", "总共", "比例"], [
        ["prefill 填充", f"{stats.prefill_padding_slots} 个填充槽位", f"{stats.prefill_slots} 个槽位 (B×P)",
         f"{stats.prefill_padding_waste:.1%}"],
        ["decode 空转", f"{stats.decode_idle_row_steps} 行·步", f"{stats.decode_row_steps} 行·步 (B×步数)",
         f"{stats.decode_idle_waste:.1%}"],
        ["KV 浪费", f"{wasted_kv} 槽·步（空着的槽）", f"{stats.kv_slot_steps_held} 槽·步（预留的 B×max_len，每次前向）",
         f"{stats.kv_waste:.1%}"],
    ]))
    print(f"最大的一批预留 KV {stats.peak_kv_slots_held} 个槽（{mib(stats.peak_kv_slots_held)}），"
          f"从这批开始一直占到这批最长的行结束。")
    tokens = stats.generated_tokens
    print(f"\n同一混合负载的时间（各只跑一次）：step03 逐个 {t_seq:.1f} s（{tokens / t_seq:.1f} tokens/s），"
          f"step04 批大小 {B} {t_batch:.1f} s（{tokens / t_batch:.1f} tokens/s），{t_seq / t_batch:.2f}×")
    return {"batch_size": B,
            "prefill_padding_waste": round(stats.prefill_padding_waste, 4),
            "decode_idle_waste": round(stats.decode_idle_waste, 4),
            "kv_reserved_waste": round(stats.kv_waste, 4),   # 名字沿用；定义与 step05 的 kv_waste 相同
            "kv_waste": round(stats.kv_waste, 4),
            "mixed_workload_ratio_vs_sequential": round(t_seq / t_batch, 3)}


@torch.inference_mode()
def decode_step_profile(args, s: cli.Session, sizes: list[int]) -> dict:
    """一次 decode 前向（B 行各 1 个 token，上下文 32）的耗时随 B 的变化，以及其中线性层矩阵乘占多少；
    与 roofline 比：内存上限 B × 带宽 / 权重字节（读一遍权重服务 B 行），计算上限 算力 / 每 token 运算量。"""
    context, repeats = 32, 5 if args.quick else 10
    linears = [m for m in s.model.modules() if isinstance(m, Linear)]          # 含 lm_head
    flop_per_token = 2 * sum(m.in_features * m.out_features for m in linears)  # 每个矩阵权重一次乘加
    linear_bytes = flop_per_token // 2 * s.dtype.itemsize                      # 下面单独计时的矩阵乘读的字节
    bw, flops = memory_bandwidth(s.device), matmul_flops(s.device)
    roofline = Roofline(bw)
    rows, step_ms = [], {}
    for B in sizes:
        cache = PreallocKVCache(s.cfg, context + repeats + 2, s.device, s.dtype, batch_size=B)
        pad = torch.zeros(B, dtype=torch.long, device=s.device)                # 等长：不需要填充
        forward(s.model, cache, torch.zeros(B, context, dtype=torch.long, device=s.device), pad)   # prefill
        x = torch.zeros(B, 1, dtype=torch.long, device=s.device)               # (B, 1)
        t = median_time(lambda: forward(s.model, cache, x, pad), repeats=repeats, warmup=1, device=s.device)
        xs = {n: torch.randn(B, n, device=s.device, dtype=s.dtype) for n in {m.in_features for m in linears}}
        t_lin = median_time(lambda: [m.matmul(xs[m.in_features]) for m in linears], repeats=repeats, warmup=1,
                            device=s.device)                                   # (B, in) x (in, out)，与模型里的一样（--linear）
        weight_bytes = weight_bytes_per_step(s.model, rows=B)                  # B 行各查 1 行嵌入表
        roof = min(B / roofline.seconds(weight_bytes), flops / flop_per_token)
        step_ms[B] = t * 1e3
        rows.append([B, f"{t * 1e3:.1f}", f"{t / (step_ms[sizes[0]] / 1e3):.2f}×", f"{B / t:.1f}", f"{roof:.0f}",
                     f"{B / t / roof:.0%}", f"{t_lin * 1e3:.1f}", f"{linear_bytes / t_lin / 1e9:.1f}",
                     f"{B * flop_per_token / t_lin / 1e9:.1f}"])
    print(f"\n机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}")
    weight_bytes = weight_bytes_per_step(s.model)
    print(f"roofline：每次 decode 前向读权重 {weight_bytes / 2**20:.0f} MiB（common/bench.py 的 weight_bytes_per_step），"
          f"本次实测读带宽 {bw / 1e9:.1f} GB/s → 内存上限 B × {bw / weight_bytes:.1f} tokens/s；"
          f"实测矩阵乘（1024² 方阵）{flops / 1e9:.0f} GFLOP/s，"
          f"每 token {flop_per_token / 1e9:.2f} GFLOP → 计算上限 {flops / flop_per_token:.0f} tokens/s（与 B 无关）。")
    print(f"一次 decode 前向 vs 批大小（上下文 {context}，取 {repeats} 次的中位数；"
          f"\"线性层\"= 只把全部线性层的矩阵乘 (B, in) x (in, out) 做一遍）：")
    print(table(["B", "前向 (ms)", f"时间 / B={sizes[0]}", "tokens/s", "roofline 上限", f"达到（@ {bw / 1e9:.1f} GB/s）",
                 "线性层 (ms)", f"线性层读权重 GB/s（带宽 {bw / 1e9:.1f}）", "线性层 GFLOP/s"], rows))
    return {"memory_bandwidth_gb_s": round(bw / 1e9, 2), "matmul_gflop_s": round(flops / 1e9, 1),
            **{f"decode_step_ms_b{B}": round(ms, 2) for B, ms in step_ms.items()}}


def throughput(args, s: cli.Session, sizes: list[int]) -> dict:
    """端到端吞吐：同一批请求，step03 一个一个地跑 vs step04 不同批大小。负载：不同内容、同样长度的提示词
    （LONG_PROMPT 里互不重叠的 32 个 token），--ignore-eos 都生成同样多的 token —— 没有填充也没有空转，
    只看"一次读权重服务 B 行"本身带来多少（有填充和空转的混合负载见上面的检查部分）。"""
    num_requests, new_tokens, plen = (8, 16, 32) if args.quick else (16, 64, 32)
    long_ids = s.tok.encode(LONG_PROMPT)
    requests = [Request(long_ids[i * plen:(i + 1) * plen], new_tokens, SamplingParams(), ignore_eos=True)
                for i in range(num_requests)]
    tokens = num_requests * new_tokens
    # 每一轮把 step03 逐个与各个批大小挨着跑一遍，跑 repeats 轮，各取中位数（模型已被前面的检查预热）
    repeats = 1 if args.quick else 3
    seq_times, batch_times, counts = [], {b: [] for b in sizes}, {}
    for _ in range(repeats):
        seq_times.append(timed(lambda: run_step03(s, requests))[1])
        for b in sizes:
            (_, stats), t = timed(lambda: generate_batch(s.model, requests, b, s.tok.eos_ids))
            batch_times[b].append(t)
            counts[b] = (stats.prefill_steps, stats.num_forwards)
    t_seq = statistics.median(seq_times)
    rows = [["step03 逐个", "-", tokens, f"{t_seq:.2f}", f"{tokens / t_seq:.1f}", "1.00×"]]
    tok_s = {}
    for b in sizes:
        t = statistics.median(batch_times[b])
        tok_s[b] = tokens / t
        rows.append([f"step04 批大小 {b}", *counts[b], f"{t:.2f}", f"{tok_s[b]:.1f}", f"{t_seq / t:.2f}×"])
    print(f"\n吞吐（{num_requests} 个请求，提示词各 {plen} tokens，各生成 {new_tokens} tokens，--ignore-eos；"
          f"{'每项只跑一次' if repeats == 1 else f'{repeats} 轮交替运行、各取中位数'}）：")
    print(table(["方式", "批数", "前向次数", "总时间 (s)", "tokens/s", "对 step03 逐个"], rows))
    B = args.max_batch_size
    return {"throughput_ratio_vs_sequential": round(tok_s[B] * t_seq / tokens, 3),
            "sequential_tok_per_s": round(tokens / t_seq, 2),
            "batched_tok_per_s": round(tok_s[B], 2)}


def chapter(args, s: cli.Session) -> bool:
    checks, notes = {}, []
    figures = check_workload(args, s, checks, notes)
    sizes = sorted({1, 4, 8, args.max_batch_size} if args.quick else {1, 2, 4, 8, 16, args.max_batch_size})
    figures |= decode_step_profile(args, s, sizes)
    figures |= throughput(args, s, sizes)
    cli.print_checks(checks, notes)
    if args.json:
        cli.emit_json(cli.chapter_json(STEP, s, checks, figures))
    return all(checks.values())


def main(args) -> bool:
    params = params_from_args(args)
    stop = tuple(args.stop or ())
    if any(not t for t in stop):
        raise UserError("--stop must not be empty")
    s = cli.load_session(args)
    if args.prompt is None:
        return chapter(args, s)
    # 先编码、检查全部提示词，任何一个有错都在开始生成前报告
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    # 每个请求各自从 params.seed 开始（同 step03 单独生成）：输出不受同批里有哪些别的请求影响
    requests = [Request(ids, args.max_new_tokens, params, args.ignore_eos, stop) for ids in prompt_ids]
    outputs, stats = generate_batch(s.model, requests, args.max_batch_size, s.tok.eos_ids, s.tok)
    cli.print_generations(s, args.prompt, outputs)
    print(f"\n{stats.prefill_steps} 批；prefill 填充浪费 {stats.prefill_padding_waste:.1%}，"
          f"decode 空转浪费 {stats.decode_idle_waste:.1%}，KV 浪费 {stats.kv_waste:.1%}")
    if args.json:
        cli.emit_json(cli.generation_json(s, args.prompt, prompt_ids, outputs))
    return True


def make_parser():
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    p.add_argument("--max-batch-size", type=cli.positive_int, default=8, help="每批最多几个请求（默认 8）")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="停止字符串（可重复）：新生成的文本里出现它就停（包含补全它的那个 token），同 step02/03")
    return p


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
