"""共用的测试夹具：真实默认模型（只加载一次）、离线创建的随机小模型、运行 run.py 的辅助函数。"""
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.cli import open_session  # noqa: E402
from common.weights import load_model  # noqa: E402

TINY_ARCHS = ("llama", "qwen2", "qwen3")

# make test 用 pytest -n 2（pytest-xdist）：两个 worker 进程各占一个核。每个 worker 与它启动的子进程（run.py、notebook、
# torchrun）都只用一个线程：2 核上 2 个 worker × 2 个线程会互相等待（超订），比一个一个跑还慢。
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def make_tiny_model_dir(path: Path, arch: str = "llama", seed: int = 0, lm_head_std: float | None = None,
                        **overrides) -> Path:
    """用 transformers 的配置类离线造一个随机小模型（hidden 64，4 个 query 头 / 2 个 KV 头），存成 HF 目录。
    只供单元测试：结构与真实模型相同，数值没有意义。lm_head_std：LM head 权重改用这个标准差（默认随配置初始化）。"""
    from transformers import (AutoModelForCausalLM, LlamaConfig, MinistralConfig, MistralConfig, Qwen2Config,
                              Qwen3Config)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
           "ministral": MinistralConfig}[arch]
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
              tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.float32)
    if lm_head_std is not None:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, lm_head_std)
    model.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def single_thread_for_tiny_models(request):
    """不用真实模型的测试单线程跑：随机小模型的矩阵只有几十维，第二个线程只带来同步开销；
    机器上还有别的负载时（CI、并行的其他进程），两个线程互相等待，会慢一个数量级。用真实模型的测试保持默认线程数。"""
    if "real" in request.fixturenames:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def lib():
    """step14 的 C++ 内核库（step14_weight_quant/kernels.py；第一次编译，之后从缓存加载）。编不出来就是测试失败。"""
    from step14_weight_quant import kernels
    if not kernels.kernel_available():
        pytest.fail(f"kernel build failed: {kernels.kernel_build_error()}")
    return kernels.library()


_REAL: list = []   # real 夹具建好的 Session：进程内的 run_py 用默认模型时复用它（reuse_real_model）


@pytest.fixture(scope="session")
def real():
    """真实默认模型 SmolLM2-135M-Instruct（CPU，float32），整个测试会话只加载一次。"""
    s = open_session(None, "cpu", "float32")
    _REAL.append(s)
    return s


@contextmanager
def reuse_real_model():
    """进程内的 run_py 加载默认模型、设置与 real 相同（cpu、float32、--linear auto）时，不再从磁盘读一遍、转置、打包
    （每次几秒）：cli.load_model 直接交回 real 已经装好的那一份，分词器同理。生成只读权重，所以结果与自己加载的一样；
    加载本身由 real 夹具走的同一个 load_model 覆盖。别的模型、别的设备 / dtype / 线性层照常加载；
    real 还没建（这个 worker 里还没有测试用过它）时什么也不换。"""
    from common import cli
    if not _REAL:
        yield
        return
    s, load, tokenizer = _REAL[0], cli.load_model, cli.Tokenizer

    def load_model_shared(path, device, dtype, linear="auto"):
        if Path(path).resolve() == s.path.resolve() and (str(device), dtype, linear) == (s.device, s.dtype, "auto"):
            return s.model
        return load(path, device, dtype, linear)

    def tokenizer_shared(path):
        return s.tok if Path(path).resolve() == s.path.resolve() else tokenizer(path)

    cli.load_model, cli.Tokenizer = load_model_shared, tokenizer_shared
    try:
        yield
    finally:
        cli.load_model, cli.Tokenizer = load, tokenizer


@dataclass
class Tiny:
    arch: str
    path: Path
    model: torch.nn.Module   # 我们的 Transformer
    cfg: object              # ModelConfig


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny(request, tmp_path_factory) -> Tiny:
    """三种架构各一个随机小模型（CPU，float32，没有分词器：测试直接用 token id）。"""
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    model = load_model(path, "cpu", torch.float32)
    return Tiny(request.param, path, model, model.cfg)


# 与架构无关的测试（只用到配置形状的、记账的、调度的、长时间的随机负载）只跑一种架构：
# 给测试加上 @one_arch，它拿到的 `tiny` 就只有 llama 这一个（与其他测试共用同一个实例）。
one_arch = pytest.mark.parametrize("tiny", ["llama"], indirect=True)


def make_tiny_tok_model_dir(path: Path, **overrides) -> Path:
    """随机小模型，但词表、分词器、对话模板、EOS 与默认模型相同（overrides 交给 make_tiny_model_dir）。
    只读默认模型目录里的小文件，不加载它的权重。"""
    from common.config import ModelConfig, eos_token_ids
    from common.prepare import prepare_default_model
    real_dir = prepare_default_model()
    make_tiny_model_dir(path, "llama", vocab_size=ModelConfig.from_dir(real_dir).vocab_size,
                        max_position_embeddings=2048, eos_token_id=sorted(eos_token_ids(real_dir))[0], **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real_dir / name).exists():
            shutil.copy(real_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_tok_dir(tmp_path_factory) -> Path:
    """make_tiny_tok_model_dir 的模型：给要处理文本的测试（章节模式、命令行）用。
    LM head 的权重标准差取 1（配置默认 0.02）：默认初始化的 logits 只有 ±0.5 左右，49152 个 token 的分布几乎是均匀的，
    top-p 0.95 要留下约 4.6 万个 token——每次带 top-p 的抽样都要把整个词表 topk 一遍（apply_top_p 为训练过的模型设计：
    核心集合几十个 token），章节模式与 bench/decode_speed.py 的 --quick 在这个模型上一半左右的时间花在这上面。
    标准差 1 时核心集合是几个到几十个 token，像真实模型；检查与断言都不变。"""
    return make_tiny_tok_model_dir(tmp_path_factory.mktemp("tiny_tok"), lm_head_std=1.0)


def run_py(step: str, *args: str, timeout: int = 900, threads: int | None = None,
           subprocess_: bool = False) -> subprocess.CompletedProcess:
    """像学习者一样运行某一步的 run.py：与命令行同一条路（make_parser → cli.run_main → 退出码），stdout / stderr 截下来。
    默认在本进程里跑（省掉每次启动进程、import torch 与 transformers 的几秒，make test 里这样的调用有十几个；
    默认模型复用 real 已经装好的权重与分词器，见 reuse_real_model）；
    subprocess_=True 时真的启动一个进程（threads：限定它的 torch 线程数），用于"进程本身"的行为：traceback 会不会漏到
    终端、两个进程同一个种子是否相同。"""
    if subprocess_:
        env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
        return subprocess.run([sys.executable, str(ROOT / step / "run.py"), *args],
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    import contextlib
    import importlib
    import io

    from common import cli
    module = importlib.import_module(f"{step}.run")
    parser = parser_of(module)
    out, err = io.StringIO(), io.StringIO()
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), reuse_real_model():
            try:
                cli.run_main(parser, module.main, list(args))
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch.set_num_threads(before)
    return subprocess.CompletedProcess([step, *args], code, out.getvalue(), err.getvalue())


def parser_of(run_module):
    """某一步 run.py 的命令行解析器（step01 的 run.py 没有 make_parser，用共用的那个）。"""
    from common import cli
    return run_module.make_parser() if hasattr(run_module, "make_parser") else cli.make_parser(run_module.STEP)


def accepted_sampling_params():
    """hypothesis 策略：SamplingParams.validate 接受的整个参数空间。sampled_from 里是一定要覆盖到的边界与极端值
    （温度从 0 经过次正规数到 1e300，top-p 小到 5e-324，重复惩罚从 5e-324 到 1e300）；hypothesis 自己的 floats
    也偏爱边界。step02 的采样器与 step09/10 的验证、草稿共用它。"""
    from hypothesis import strategies as st

    from step02_sampling.sampler import SamplingParams
    temperatures = st.one_of(st.sampled_from([0.0, 5e-324, 1e-45, 1e-40, 1e-38, 1e-6, 9.99e-6, 1e-5, 1e-4,
                                              0.7, 1.0, 1e6, 1e300]),
                             st.floats(min_value=0.0, max_value=1e6), st.floats(min_value=0.0, allow_infinity=False))
    top_ps = st.one_of(st.sampled_from([1e-30, 5e-324, 0.5, 1.0]),
                       st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
    min_ps = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(min_value=0.0, max_value=1.0))
    penalties = st.one_of(st.sampled_from([5e-324, 1e-45, 1e-40, 1e-6, 1.0, 1.3, 1e6, 1e300]),
                          st.floats(min_value=0.0, max_value=1e6, exclude_min=True),
                          st.floats(min_value=0.0, exclude_min=True, allow_infinity=False))
    openai_penalties = st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(min_value=-2.0, max_value=2.0))
    # token id 只用 0：测试的词表小到 1（那时 stop_token_ids=(0,) 覆盖整个词表，min_tokens 不能屏蔽它）
    biases = st.dictionaries(st.just(0), st.one_of(st.sampled_from([-100.0, 100.0]), st.floats(-100.0, 100.0)))
    return st.builds(SamplingParams, temperature=temperatures, top_k=st.one_of(st.just(0), st.integers(0, 40)),
                     top_p=top_ps, min_p=min_ps, repetition_penalty=penalties, seed=st.integers(0, 2**63 - 1),
                     presence_penalty=openai_penalties, frequency_penalty=openai_penalties, logit_bias=biases,
                     min_tokens=st.integers(0, 8), stop_token_ids=st.sampled_from([(), (0,)]))


def cli_error(run_module, argv: list[str], capsys) -> str:
    """在进程内运行某一步 run.py 的 main（与命令行同一条路：cli.run_main），断言它以一行 `error: ...`、
    退出码 2 结束，返回那一行。比启动一个进程快得多；"真的是一个进程时也没有 traceback"由
    test_prepare_and_errors 里唯一的子进程测试负责。"""
    from common import cli
    parser = parser_of(run_module)
    with pytest.raises(SystemExit) as e:
        cli.run_main(parser, run_module.main, argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert e.value.code == 2, (e.value.code, captured.err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error:"), captured.err[-2000:]
    return lines[0]
