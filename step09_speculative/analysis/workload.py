"""step09 的基准负载：投机解码只在"接下来的 token 能从上文猜出来"时才赚。

- grounded：答案大段取自提示词里给的内容——照抄一段话、改代码里的变量名、给函数加注释、纠正错别字、
  把列表换个格式、总结一段文字。prompt lookup 在这里能猜中成串的 token；
- chat：开放的闲聊问题，答案里很少有提示词里的原文——prompt lookup 很少猜中（验证白做，按请求暂停投机来止损）。

全部套对话模板、贪心、遇到 EOS 就停：step08 与 step09 产出同样的 token，所以时间之比就是速度之比。
"""
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request

GROUNDED = [
    "Rename the variable `total` to `result` in the following Python function. Reply with the complete function "
    "only.\n\n```python\ndef sum_of_squares(numbers):\n    total = 0\n    for n in numbers:\n        if n > 0:\n"
    "            total += n * n\n    return total\n```",
    "Copy the following paragraph exactly, without changing any word:\n\nThe library opens at nine in the morning "
    "and closes at six in the evening. Visitors may borrow up to five books at a time, and each book can be kept for "
    "three weeks. Late returns cost ten cents per day. The reading room on the second floor is quiet and has free wifi.",
    "Add a docstring to this function and return the whole function:\n\n```python\ndef is_palindrome(text):\n"
    "    cleaned = ''.join(c.lower() for c in text if c.isalnum())\n    return cleaned == cleaned[::-1]\n```",
    "Correct the spelling mistakes in this text and return the corrected text:\n\nThe wether today is sunny and warm. "
    "Many peple went to the beech to swim and play volleyball. In the evning, the temprature dropped and everyone "
    "went home.",
    "Here is a shopping list: apples, bread, milk, eggs, cheese, tomatoes, rice, and coffee. Write the same list as a "
    "numbered list, one item per line.",
    "Summarise the following text in two sentences.\n\nThe city council met on Tuesday to discuss the new bus routes. "
    "After two hours of debate, the council voted to add three routes that connect the northern suburbs to the city "
    "centre. The new buses will run every fifteen minutes during the day and every thirty minutes at night. The first "
    "routes will open in March, and the rest will follow in June.",
    "Convert this JSON object to a Python dictionary literal:\n\n{\"name\": \"Alice\", \"age\": 30, \"city\": "
    "\"Paris\", \"languages\": [\"French\", \"English\"], \"member\": true}",
    "Quote the sentence from the text below that gives the price, word for word.\n\nOur bakery sells fresh bread "
    "every morning. A loaf of sourdough costs four dollars and fifty cents. We also sell croissants, muffins and "
    "cakes. The shop is closed on Mondays.",
]

CHAT = [
    "What are three tips for staying healthy?",
    "Write a short poem about the sea.",
    "Why is the sky blue? Explain it simply.",
    "Give me an idea for a weekend trip.",
    "What is the difference between a cat and a dog as a pet?",
    "Tell me a fun fact about space.",
    "How do I make a good cup of tea?",
    "Suggest a name for a new coffee shop and explain why.",
]


def requests(tok, texts: list[str], max_new: int) -> list[Request]:
    """贪心、套对话模板、遇到 EOS 就停。"""
    return [Request(tok.encode(t, chat=True), max_new, SamplingParams()) for t in texts]
