"""章节模式的三种负载（固定内容，每次运行完全相同）：

(a) 共享系统提示词：一段约 600 token 的系统提示词 + 各不相同的短问题（套对话模板）；
(b) 多轮对话：几段对话、每段几轮；每一轮把整段历史（含前几轮模型回复的 token id）按对话模板重新发一遍；
(c) 小池子：几段共享的文档前缀 × 不同的问题，一部分请求做并行采样（n 个样本），池子小到必然回收与抢占。
"""
from dataclasses import dataclass, field

from common.prompts import LONG_PROMPT
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
ROOMS = ["the reading hall", "the map room", "the music studio", "the maker space", "the quiet room", "the archive"]

SYSTEM_PROMPT = (
    "You are the help-desk assistant of the public library of Alderbrook. Answer in one or two short sentences, "
    "politely, using only the facts below. If the facts do not answer the question, say that the staff at the "
    "front desk can help.\n\nOpening hours:\n"
    + "".join(f"- {d}: {7 + i % 3}:30 to {17 + i % 4}:00; the children's floor opens one hour later.\n"
              for i, d in enumerate(DAYS))
    + "\nRooms:\n"
    + "".join(f"- {r.capitalize()} is on floor {i + 1}, seats {12 + 7 * i} people, and can be booked for "
              f"{2 + i % 3} hours a day.\n" for i, r in enumerate(ROOMS))
    + "\nRules:\n"
    "- A library card is free for residents and costs 15 euros a year for everyone else.\n"
    "- Members may borrow up to 12 books, 4 films and 2 board games at the same time.\n"
    "- Books are lent for three weeks, films for one week, board games for two weeks.\n"
    "- A loan can be renewed twice online unless another member has reserved the item.\n"
    "- Late returns cost 20 cents per item per day, up to 5 euros per item.\n"
    "- Lost items are replaced at the purchase price plus a handling fee of 3 euros.\n"
    "- Food is not allowed in the reading hall; covered drinks are fine everywhere.\n"
    "- Printing costs 10 cents per black-and-white page and 40 cents per colour page.\n"
    "- Wi-Fi is free; the network name is AlderbrookLibrary and no password is needed.\n"
    "- Children under 10 must be accompanied by an adult on every floor except the children's floor.\n"
)

QUESTIONS = [   # (a) 每个请求一个；(c) 也从这里取
    "When does the library open on Monday?", "How much does a library card cost?",
    "How many books can I borrow?", "Can I eat in the reading hall?", "How long can I keep a film?",
    "What is the Wi-Fi password?", "How much is a colour print?", "Where is the music studio?",
    "What happens if I lose a book?", "Can I renew a loan?", "How late is the library open on Friday?",
    "How many people fit in the map room?", "Is the library open on Sunday?", "Can my child come alone?",
    "How much is the fine for a late book?", "Can I book the maker space?",
]


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """对话模板渲染成文本再编码（模板里已有特殊 token，不再加）；末尾是 "assistant" 的开头，等模型接着写。"""
    text = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.hf(text, add_special_tokens=False).input_ids


def shared_prefix_workload(tok, quick: bool) -> list[Request]:
    """(a) 同一段系统提示词 + 不同的问题，全部贪心：完整 16 个请求、各最多 32 个新 token；--quick 8 个、各 16 个。"""
    n, max_new = (8, 16) if quick else (16, 32)
    return [Request(chat_ids(tok, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]),
                    max_new) for q in QUESTIONS[:n]]


# ---------- (b) 多轮对话 ----------

CONVERSATIONS = [
    ["I want to cook pasta for four people tonight. How much dry pasta should I buy?",
     "How much salt goes into the water?", "Which sauce is quick to make?", "Can I prepare the sauce in advance?",
     "What wine would go with it?"],
    ["I am learning Python. What is a list?", "How do I add an element to it?", "And how do I remove one?",
     "What is the difference between a list and a tuple?", "When should I use a dictionary instead?"],
    ["I am planning a week-long trip to Japan in spring. Which cities should I visit?",
     "How do I travel between them?", "Is a rail pass worth it?", "What should I eat in Osaka?",
     "Any tips for visiting temples?"],
    ["My tomato plants have yellow leaves. What could be wrong?", "How often should I water them?",
     "Should I use fertilizer?", "When will the tomatoes be ripe?", "Can I grow them indoors next year?"],
    ["Explain what a black hole is in simple words.", "How do they form?", "Can light escape from one?",
     "What is the event horizon?", "Is there one near Earth?"],
    ["I want to start running. How far should I run in the first week?", "How many days a week?",
     "What shoes do I need?", "Should I stretch before running?", "How do I avoid knee pain?"],
]


@dataclass
class Conversation:
    """一段对话：messages 是文本形式的历史，ids 是上一轮真正发给引擎的 token id（含模型回复的原样 token）。"""
    questions: list[str]
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    turn: int = 0


def first_turn(tok, conv: Conversation) -> list[int]:
    conv.messages = [{"role": "user", "content": conv.questions[0]}]
    conv.ids = chat_ids(tok, conv.messages)
    conv.turn = 1
    return conv.ids


def next_turn(tok, conv: Conversation, reply_ids: list[int]) -> tuple[list[int], list[int]]:
    """下一轮的提示词 = 上一轮的提示词 + 模型回复的 token id（原样）+ 模板在"回复之后、下一轮生成之前"的那段文字。
    那段文字用占位符渲染一次整段对话、在占位符处切开得到，所以适用于任何对话模板。

    返回 (ids, retokenized)：后者是把回复解码成文本、整段历史重新套模板编码得到的 id。两者不同时，按文本重发历史的
    客户端（大多数 API 都是这样）会在回复处与缓存分叉，分叉点之后的前缀全都用不上。"""
    eos = tok.eos_ids
    content = reply_ids[:-1] if reply_ids and reply_ids[-1] in eos else reply_ids   # 模板自己会在回复后加结束符
    question = conv.questions[conv.turn]
    placeholder = "\x00REPLY\x00"
    with_placeholder = tok.hf.apply_chat_template(
        conv.messages + [{"role": "assistant", "content": placeholder}, {"role": "user", "content": question}],
        tokenize=False, add_generation_prompt=True)
    before, after = with_placeholder.split(placeholder)
    if before != tok.hf.apply_chat_template(conv.messages, tokenize=False, add_generation_prompt=True):
        raise ValueError("chat template does not render earlier turns unchanged; cannot append token ids")
    ids = conv.ids + content + tok.hf(after, add_special_tokens=False).input_ids
    conv.messages = conv.messages + [{"role": "assistant", "content": tok.decode(content)},
                                     {"role": "user", "content": question}]
    conv.ids, conv.turn = ids, conv.turn + 1
    return ids, chat_ids(tok, conv.messages)


def conversations(quick: bool) -> list[Conversation]:
    """完整：6 段对话 × 5 轮；--quick：2 段 × 3 轮。"""
    n_conv, n_turns = (2, 3) if quick else (6, 5)
    return [Conversation(qs[:n_turns]) for qs in CONVERSATIONS[:n_conv]]


# ---------- (c) 小池子 ----------

def small_pool_workload(tok, quick: bool, n_samples: int = 2, base_seed: int = 2000) -> list[Request]:
    """几段文档前缀（LONG_PROMPT 的不同截取，各约 100 token）× 不同的问题；每段的第一个问题做并行采样
    （n_samples 个样本，种子 base_seed + 偏移），其余贪心；输出长度各不相同。全部 ignore_eos：谁在哪一步被抢占、
    哪一块被回收只取决于长度，与数值无关。"""
    text = tok.encode(LONG_PROMPT)
    n_docs, n_q, max_new = (2, 2, 8) if quick else (3, 4, 32)
    requests = []
    for d in range(n_docs):
        doc = text[d * 150:d * 150 + 100]
        for q in range(n_q):
            ids = doc + tok.hf(f"\nQuestion {q + 1}: {QUESTIONS[q + d * n_q]}\nAnswer:", add_special_tokens=False).input_ids
            if q == 0:
                sampled = Request(ids, max_new + 8 * d, SamplingParams(temperature=0.8, top_p=0.95, seed=base_seed + 10 * d),
                                  ignore_eos=True)
                requests += sampled.parallel_samples(n_samples)
            else:
                requests.append(Request(ids, max_new + 8 * q, ignore_eos=True))
    return requests

