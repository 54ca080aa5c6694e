"""各步 run.py 章节模式共用的固定提示词：(名字, 文本, 是否套对话模板)。"""

CHAPTER_PROMPTS = [
    ("english", "The three primary colors are", False),
    ("chinese", "请用一句话介绍长城：", False),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("chat", "What is the capital of France? Answer in one sentence.", True),
]

# 几百个 token 的长提示词（step03 起用来检查长上下文下的 KV cache 与位置偏移）
LONG_PROMPT = (
    "Below is a short history of computing, followed by a question.\n\n"
    + " ".join(
        f"In chapter {i}, the engineers of era {i} improved the machines of era {i - 1}: "
        f"they made memory {i} times larger, wrote faster compilers, and taught {i * 10} new students."
        for i in range(1, 16)
    )
    + "\n\nQuestion: what did the engineers of the last era do? Answer:"
)
