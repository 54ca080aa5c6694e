"""step11 的聊天页面在真实的无界面浏览器里（Debian 的 chromium + chromium-driver，用 selenium 驱动）：
输入问题 → 看到 token 一段段流出来 → 按"停止"（服务器取消这个请求、块还回池子）→ 再问一个（带着上一轮的历史）→
截图存成测试产物（.pytest_cache/d/step11/chat_page.png）。

CI（.ci/run）在没有浏览器时用 apt-get 装上；别处没有 chromium 时跳过，并打印原因。
页面里的中文字体：没有装系统的中文字体时，用 mplfonts 包里的 Noto Sans CJK SC（经 fontconfig），截图里不是方框。
"""
import shutil
import time
from pathlib import Path

import pytest

from test_step11_fake_engine import FakeEngine
from test_step11_serving import Served, tok  # noqa: F401  (tok 是模块级夹具)

FONTS_CONF = """<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "fonts.dtd">
<fontconfig>
  <include ignore_missing="yes">/etc/fonts/fonts.conf</include>
  <dir>{dir}</dir>
  <cachedir>{cache}</cachedir>
</fontconfig>
"""


class RecordingEngine(FakeEngine):
    """记下每个请求的提示词：检查第二轮确实带着第一轮的问答。从不因 EOS 结束：第一轮一定还在生成时被"停止"。"""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prompts = []
        self.eos_ids = []

    def add_request(self, r):
        self.prompts.append(r.prompt_ids)
        return super().add_request(r)


def browser_or_skip():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        reason = "chromium / chromedriver not installed (apt-get install -y chromium chromium-driver; .ci/run does it)"
        print(f"\nSKIP chat page test: {reason}")
        pytest.skip(reason)
    pytest.importorskip("selenium")
    return chromium, driver


def test_chat_page_streams_stops_and_asks_again(tok, tmp_path, request):  # noqa: F811
    chromium, driver_path = browser_or_skip()
    import mplfonts
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    conf = tmp_path / "fonts.conf"
    conf.write_text(FONTS_CONF.format(dir=Path(mplfonts.__file__).parent / "fonts", cache=tmp_path / "fc-cache"))
    engine = RecordingEngine(tok, step_s=0.03)         # 每步 30 ms：按"停止"时回答一定还没生成完
    server = Served(engine, tok)
    opts = Options()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1000,720",
              "--lang=zh-CN"):
        opts.add_argument(a)
    browser = webdriver.Chrome(service=Service(driver_path, env={"FONTCONFIG_FILE": str(conf)}), options=opts)
    wait = WebDriverWait(browser, 30, poll_frequency=0.05)
    try:
        browser.get(server.url + "/")
        wait.until(lambda b: "tiny" in b.find_element(By.ID, "model").text)
        box = browser.find_element(By.ID, "input")
        box.send_keys("请介绍一下长城")
        browser.find_element(By.ID, "send").click()
        bot = lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .body")   # noqa: E731
        wait.until(lambda b: bot() and len(bot()[0].text) >= 3)                       # token 流进来了
        seen = len(bot()[0].text)
        wait.until(lambda b: len(bot()[0].text) > seen)                              # 而且还在增长
        browser.find_element(By.ID, "stop").click()
        wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle")
        stopped = bot()[0].text
        stats = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[0].text
        assert "已停止" in stats and "首 token" in stats and "token/s" in stats, stats
        server.wait_idle()                               # 服务器发现断开、取消了它：池子全空
        assert server.pool_is_free()
        assert server.metric('llm_requests_total{finish_reason="abort"}') == 1
        time.sleep(0.2)
        assert bot()[0].text == stopped                  # 停下之后不再增长
        mt = browser.find_element(By.ID, "max-tokens")
        mt.clear()
        mt.send_keys("12")
        box.send_keys("再说一遍\n")                       # Enter 发送
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='1']")) == 2)
        stats2 = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[1].text
        assert "到达长度上限" in stats2 or "完成" in stats2, stats2
        assert bot()[1].text
        second_prompt = tok.decode(engine.prompts[-1])  # 第二轮的提示词里有第一轮的问题和（被停止的）回答
        assert "请介绍一下长城" in second_prompt and stopped in second_prompt and "再说一遍" in second_prompt
        cache = getattr(request.config, "cache", None)      # -p no:cacheprovider 时没有：放进这个测试的临时目录
        shot = (Path(cache.mkdir("step11")) if cache else tmp_path) / "chat_page.png"
        browser.save_screenshot(str(shot))
        print(f"\nscreenshot: {shot}")
        assert shot.stat().st_size > 10_000
    finally:
        browser.quit()
        server.stop()
