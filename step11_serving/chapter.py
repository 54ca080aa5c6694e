"""step11 的章节模式（run.py 不带 --prompt 时调用）：在本机一个空闲端口上起服务器，用真实的 openai 客户端驱动它。

[1] 经过服务器 == 直接用同一步的引擎：章节提示词，非流式返回的 token（return_token_ids）与 engine.generate 逐 token
    相同（near-tie 规则），流式拼起来的文本 == 非流式的文本，usage 精确；n = 3 的带种子样本与引擎的三个种子相同；
[2] 断开与坏输入：16 个流式客户端、四分之一中途断开 → 其余完成，之后每个 KV 块都空闲、/metrics 显示 0 个在跑；
    一组坏请求各自得到 4xx 的 JSON 错误，服务器照常服务；
[3] 多轮对话：第二轮把第一轮的问答一起发回去，前缀缓存命中（step06 起的引擎）；
[4] 负载：并发 1 / 4 / 8 的多轮对话（bench_serving.py 的同一个负载发生器），吞吐、TTFT、TPOT；
    并发 8 的同样请求直接交给 engine.generate()：服务器多花了多少（server_overhead_vs_offline）。
与 llama.cpp 的 llama-server 并排比较是单独的基准：step11_serving/bench_serving.py（要先编译 llama-server）。
"""
import asyncio
import statistics

import httpx
import openai

from common import cli
from common.bench import machine, table
from common.compare import MARGIN_TOL, compare
from common.harness import Checks, finish, percentile, pool_is_free, stage
from common.prompts import CHAPTER_PROMPTS
from step02_sampling.sampler import SamplingParams, draw_margin
from step04_static_batching.request import Request
from step11_serving import bench_serving as load
from step11_serving.server_thread import serve_in_thread
from step11_serving.engines import build_engine

STEP = "step11_serving"


def chapter(args, s: cli.Session) -> bool:
    checks, figures, engines = Checks(), {}, []
    n_new = 16 if args.quick else 48

    def engine():
        e = build_engine(args.engine, s, args)
        engines.append(e)
        return e

    print(f"机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}；服务 {args.engine} 的引擎", flush=True)
    served = engine()
    with serve_in_thread(s, served, args.block_size, max_waiting=256) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stage(f"\n[1] 经过服务器 vs 直接 engine.generate：{len(CHAPTER_PROMPTS)} 个章节提示词各 {n_new} token；n = 3 ...")
        rows, same, usage_ok, stream_ok = [], True, True, True
        for name, text, chat in CHAPTER_PROMPTS:
            ids = s.encode(text, chat, n_new)
            ref = engine().generate([Request(ids, n_new)]).outputs[0]
            kw = dict(model=s.path.name, max_tokens=n_new, temperature=0, extra_body={"return_token_ids": True})
            if chat:
                msgs = [{"role": "user", "content": text}]
                full = client.chat.completions.create(messages=msgs, **kw)
                got_text = full.choices[0].message.content
                pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    messages=msgs, stream=True, **kw) if c.choices]
            else:
                full = client.completions.create(prompt=text, **kw)
                got_text = full.choices[0].text
                pieces = [c.choices[0].text for c in client.completions.create(prompt=text, stream=True, **kw)]
            got = full.choices[0].token_ids
            c = compare(name, ids, ref, got, s.full_logits, MARGIN_TOL[s.dtype])
            if not c.equal:
                checks.note(c.describe())
            same &= c.ok and full.choices[0].prompt_token_ids == ids
            stream_ok &= "".join(pieces) == got_text == s.tok.decode(got)
            usage_ok &= (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(ids), len(got))
            rows.append([name, len(ids), len(got), full.choices[0].finish_reason, "相同" if c.equal else "near-tie",
                         repr(got_text[:40])])
        print(table(["提示词", "提示词 token", "生成 token", "结束原因", "vs engine.generate", "文本（开头）"], rows))
        checks["served_tokens_equal_engine_generate"] = same
        checks["stream_equals_full_equals_decode"] = stream_ok
        checks["usage_exact"] = usage_ok
        ids = s.encode(CHAPTER_PROMPTS[3][1], True, n_new)
        p = dict(temperature=0.8, top_p=0.95)
        refs = engine().generate([Request(ids, n_new, SamplingParams(**p, seed=7 + k)) for k in range(3)]).outputs
        full = client.chat.completions.create(model=s.path.name, messages=[{"role": "user", "content": CHAPTER_PROMPTS[3][1]}],
                                              n=3, max_tokens=n_new, seed=7, extra_body={"return_token_ids": True}, **p)
        res = [compare(f"n3#{k}", ids, refs[k], full.choices[k].token_ids, s.full_logits, MARGIN_TOL[s.dtype],
                       draw_margin(SamplingParams(**p, seed=7 + k))) for k in range(3)]
        checks["n3_seeded_samples_equal_engine"] = all(r.ok for r in res)

        stage("\n[2] 16 个流式客户端、4 个中途断开；一组坏请求 ...")
        soak = asyncio.run(load.disconnect_soak(server.url, 16, n_new))
        figures.update(soak)
        print("  " + "，".join(f"{k.removeprefix('disconnect_soak_')} {v}" for k, v in soak.items()))
        checks["disconnect_frees_every_block"] = (soak["disconnect_soak_disconnected"] == 4 and
                                                  soak["disconnect_soak_completed"] == 12 and
                                                  soak["disconnect_soak_kv_blocks_used_after"] == 0 and
                                                  soak["disconnect_soak_running_after"] == 0)
        bad = [{"messages": []}, {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
               {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
               {"messages": [{"role": "user", "content": "x"}], "model": "no-such-model"},
               {"messages": [{"role": "user", "content": "x" * 10}], "max_tokens": s.cfg.max_position_embeddings}]
        codes = [httpx.post(server.url + "/v1/chat/completions", json=b).status_code for b in bad]
        print(f"  坏请求 → {codes}")
        checks["bad_requests_get_4xx_json"] = all(400 <= c < 500 for c in codes) and httpx.get(
            server.url + "/health").status_code == 200

        stage("\n[3] 两轮对话：第二轮把第一轮的问答一起发回去 ...")
        msgs = [{"role": "system", "content": load.SYSTEM}, {"role": "user", "content": load.QUESTIONS[0]}]
        first = client.chat.completions.create(model=s.path.name, messages=msgs, max_tokens=n_new, temperature=0)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": load.FOLLOW_UPS[0]}]
        second = client.chat.completions.create(model=s.path.name, messages=msgs, max_tokens=n_new, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        figures["multi_turn_cached_tokens"] = cached
        figures["multi_turn_hit_rate"] = round(cached / second.usage.prompt_tokens, 4)
        print(f"  第二轮：{second.usage.prompt_tokens} 个提示词 token，其中 {cached} 个来自前缀缓存")
        if args.engine != "step05":                         # step05 没有前缀缓存
            checks["multi_turn_prefix_cache_hits"] = cached > 0

        levels = [1, 8] if args.quick else [1, 4, 8]
        stage(f"\n[4] 多轮对话负载，并发 {levels}（每段对话 2 轮、每个回答 {n_new} token）...")
        rows, recorded = [], []
        for c in levels:
            res, wall = asyncio.run(load.run_level(server.url, c, 2 * c, 2, n_new, recorded if c == levels[-1] else None))
            tok_s = sum(r.tokens for r in res) / wall
            figures[f"tok_s_c{c}"] = round(tok_s, 2)
            figures[f"ttft_p50_ms_c{c}"] = round(percentile([r.ttft for r in res], .5) * 1e3, 1)
            rows.append([c, len(res), f"{tok_s:.1f}", f"{percentile([r.ttft for r in res], .5) * 1e3:.0f}",
                         f"{percentile([r.tpot for r in res], .5) * 1e3:.1f}",
                         f"{statistics.mean(r.cached_tokens / r.prompt_tokens for r in res):.0%}"])
        print(table(["并发", "请求", "输出 token/s", "TTFT p50 (ms)", "TPOT p50 (ms)", "前缀缓存命中（平均）"], rows))
    checks["clean_shutdown_every_block_free"] = server.app.state.clean_shutdown and all(map(pool_is_free, engines))
    reqs = [Request(load.encode_messages(s.tok, m), n_new, SamplingParams(), ignore_eos=True) for m in recorded]
    out = engine().generate(reqs)
    off = out.stats.generated_tokens / out.stats.wall_s
    figures["server_overhead_vs_offline"] = round(figures[f"tok_s_c{levels[-1]}"] / off, 3)
    print(f"并发 {levels[-1]} 的同样 {len(reqs)} 个请求直接 engine.generate()：{off:.1f} token/s；"
          f"服务器 ÷ 离线 = {figures['server_overhead_vs_offline']:.3f}（服务器在本进程的线程里，与负载发生器抢 GIL）")
    return finish(STEP, s, checks, figures, args.json)
