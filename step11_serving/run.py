"""step11_serving：把 step05 起任何一步的引擎变成 OpenAI 兼容的流式 HTTP 服务器（默认最新一步 step10 的引擎；--tp / --pp 时服务器就是 rank 0）。

    python -m step11_serving.api_server [--port 8000] [--api-key KEY] [引擎参数]    # 只起服务器（make serve），浏览器打开即可聊天
    python step11_serving/run.py [--quick] [--json]                                  # 章节模式（chapter.py）
    python step11_serving/run.py --prompt "..." --max-new-tokens 32 [--chat] [--n K]  # 生成模式：经过服务器
    python step11_serving/run.py --prompt "..." --weights q4_1                       # 服务器用 step14 的块权重

生成模式在本机一个空闲端口上起服务器，用真实的 openai 客户端把全部提示词作为一个批量请求发过去
（/v1/completions，prompt 是 token id 的列表：与前几步同样的 token，按给定顺序同时到达），
打印与前几步相同的 JSON；每个结果另有 served_text：服务器返回的文本（有停止字符串时截在它前面，OpenAI 的语义）。
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import cli  # noqa: E402
from step02_sampling.sampler import add_sampling_args, params_from_args  # noqa: E402
from step11_serving.server_thread import serve_in_thread  # noqa: E402
from step11_serving.engines import (DEFAULT_ENGINE, ENGINES, SLIDING_WINDOW_ENGINES, add_engine_args,  # noqa: E402
                                    add_weight_args, check_weight_args, open_serving_session, serving_engine)

STEP = "step11_serving"


def make_parser(argv=None):
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    p.add_argument("--n", type=cli.positive_int, default=1, help="每个提示词 K 个样本（种子 S, S+1, ...）")
    p.add_argument("--engine", default=DEFAULT_ENGINE, choices=list(ENGINES), help="服务哪一步的引擎")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", default=DEFAULT_ENGINE)
    name = pre.parse_known_args(sys.argv[1:] if argv is None else argv)[0].engine
    add_engine_args(p, name if name in ENGINES else DEFAULT_ENGINE)   # 未知的名字由上面的 choices 报错
    add_weight_args(p)
    return p


def main(args) -> bool:
    params, stop = params_from_args(args), list(cli.stop_from_args(args))
    # 滑动窗口模型只在生成模式、挂认识窗口的引擎时可以（章节模式还要拿别的引擎对照）
    check_weight_args(args)
    s, _ = open_serving_session(args, sliding_window=args.prompt is not None and args.engine in SLIDING_WINDOW_ENGINES)
    if args.prompt is None:
        from step11_serving.chapter import chapter
        return chapter(args, s)
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    import openai
    with serving_engine(args.engine, s, args) as engine, serve_in_thread(s, engine, args.block_size) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(
            model=s.path.name, prompt=prompt_ids, max_tokens=args.max_new_tokens, n=args.n, stop=stop or None,
            temperature=params.temperature, top_p=params.top_p, seed=params.seed,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            extra_body={"top_k": params.top_k, "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
                        "min_tokens": params.min_tokens, "stop_token_ids": list(params.stop_token_ids),
                        "ignore_eos": args.ignore_eos, "return_token_ids": True})
    choices = sorted(r.choices, key=lambda c: c.index)          # index = 第几个提示词 × n + 第几个样本
    prompts = [p for p in args.prompt for _ in range(args.n)]
    outputs = [c.token_ids for c in choices]
    cli.print_generations(s, prompts, outputs)
    print(f"\n经过 {server.url}（{args.engine} 的引擎）：{r.usage.prompt_tokens} 个提示词 token，"
          f"{r.usage.completion_tokens} 个生成 token，前缀缓存命中 {r.usage.prompt_tokens_details.cached_tokens}")
    if args.json:
        out = cli.generation_json(s, prompts, [c.prompt_token_ids for c in choices], outputs)
        for res, c in zip(out["results"], choices):
            res.update(cached_tokens=c.num_cached_tokens, finish_reason=c.finish_reason, served_text=c.text)
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
