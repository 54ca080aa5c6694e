"""在后台线程里跑 step11 的服务器（测试、run.py 的生成模式与章节模式用）：监听 127.0.0.1 的一个空闲端口，
关闭走与 Ctrl-C 相同的优雅关闭。命令行入口的前台服务器在 api_server.py（serve / main）。"""
import threading
import time
from contextlib import contextmanager
from typing import Optional

from fastapi import FastAPI

from .api_server import DrainingServer, bind, build_app, settings_for
from .async_engine import AsyncLLMEngine


class ServerThread:
    """在后台线程里跑 uvicorn，监听 127.0.0.1 的一个空闲端口（测试、run.py 的章节模式、基准用）。
    stop() 与 Ctrl-C 走同一条优雅关闭的路：停止接收 → 等进行中的响应（最多 shutdown_timeout 秒）→ 关引擎。"""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0):
        self.app = app
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = DrainingServer(app, shutdown_timeout, log_level="warning", lifespan="on")
        self.exit_code: Optional[int] = None       # 引擎死了时 1：main() 里这就是进程的退出码，这里只记下、停服务器
        app.state.aengine.on_dead = self._engine_dead
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="uvicorn")

    def _engine_dead(self, error: BaseException) -> None:
        self.exit_code = 1
        self.server.should_exit = True

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        t0 = time.perf_counter()
        while not self.server.started:
            if not self.thread.is_alive() or time.perf_counter() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


@contextmanager
def serve_in_thread(session, engine, block_size: int, max_waiting: int = 64, **settings):
    """把一个引擎挂到本机一个空闲端口上（run.py、chapter.py 用）：yield 跑着的 ServerThread，退出时优雅关闭。"""
    aengine = AsyncLLMEngine(engine, session.tok, max_waiting)
    app = build_app(aengine, session.tok, settings_for(session, engine, block_size, **settings))
    server = ServerThread(app).start()
    try:
        yield server
    finally:
        server.stop()
