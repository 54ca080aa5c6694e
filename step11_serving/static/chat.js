// 聊天页面：用 fetch 读 /v1/chat/completions 的 SSE 流（EventSource 只能发 GET，所以自己解析 `data:` 行）。
// 每轮把整段对话（system + 之前的问答 + 这个问题）作为 messages 发出去：服务器不记得对话，
// 但前缀相同，step06 起的前缀缓存会命中，第二轮的首 token 延迟（TTFT）因此不随对话变长而变长。
// "停止"调用 AbortController.abort()：连接断开，服务器取消这个请求，它的 KV 块在引擎的下一步之前就还回池子。
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];            // [{role, content}]：已经完成（或被停止）的轮次
let controller = null;         // 正在进行的请求
let model = null;

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: authHeaders() });
    const j = await r.json();
    model = j.data[0].id;
    $("model").textContent = `模型：${model}`;
  } catch (e) {
    $("model").textContent = "模型：（读不到 /v1/models，需要 API key？）";
  }
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.state = busy ? "streaming" : "idle";   // 给浏览器测试看的
}

// 逐个事件读 SSE：事件之间隔一个空行，每个事件一行 `data: ...`
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder("utf-8");   // stream: true —— 跨网络包的多字节字符也不会被拆坏
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function ask(question) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history, { role: "user", content: question });
  addMessage("user", question);
  const bot = addMessage("assistant", "");
  const body = bot.querySelector(".body");
  const stats = document.createElement("span");
  stats.className = "stats";
  bot.appendChild(stats);

  controller = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null, tLast = null, chunks = 0, usage = null, finish = null, text = "";
  const show = () => {
    const ttft = tFirst === null ? "-" : `${(tFirst - t0).toFixed(0)} ms`;
    const n = usage ? usage.completion_tokens : chunks;
    const rate = tFirst !== null && tLast > tFirst && n > 1 ? `${((n - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} token/s` : "-";
    const cached = usage && usage.prompt_tokens_details ? ` · 前缀缓存命中 ${usage.prompt_tokens_details.cached_tokens}/${usage.prompt_tokens} 提示词 token` : "";
    const why = { stop: "完成", length: "到达长度上限", abort: "被取消", stopped: "已停止" }[finish] || "生成中…";
    stats.textContent = `首 token ${ttft} · ${rate} · ${n} token${cached} · ${why}`;
  };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({
        model, messages, stream: true, stream_options: { include_usage: true },
        max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
      }),
      signal: controller.signal,
    });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error(j.error ? j.error.message : `HTTP ${r.status}`);
    }
    for await (const data of sseEvents(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        if (c.delta.content) {
          const now = performance.now();
          if (tFirst === null) tFirst = now;
          tLast = now;
          chunks += 1;
          text += c.delta.content;
          body.textContent = text;
          bot.scrollIntoView({ block: "end" });
        }
        if (c.finish_reason) finish = c.finish_reason;
      }
      show();
    }
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
    } else {
      const err = document.createElement("span");
      err.className = "stats error";
      err.textContent = `出错了：${e.message}`;
      bot.appendChild(err);
    }
  } finally {
    show();
    controller = null;
    setBusy(false);
    // 被停止的回答也留在对话里（与常见的聊天界面相同），下一轮一起发出去
    if (text) history.push({ role: "user", content: question }, { role: "assistant", content: text });
    bot.dataset.done = "1";
    $("input").focus();
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const q = $("input").value.trim();
  if (!q || controller) return;
  $("input").value = "";
  ask(q);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("messages").innerHTML = "";
});
$("api-key").addEventListener("change", loadModel);
setBusy(false);
loadModel();
