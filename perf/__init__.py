"""perf：各步之上的一层——让引擎跑得更快、与别的实现比快慢的工具，不是哪一步的课。

    compiled_decode.py   --compile：把 step05 起任何一个引擎的 decode 换成编译好的图（读引擎的 kv_cache / model / config，
                         图里调用第 05 章的分页注意力内核）
    llamacpp.py          llama.cpp 对照：同一份权重写成 F32 GGUF，贪心解码计时（step03 的 run.py 与 bench/ 用）

依赖的方向：perf 可以 import common/ 和各步（step05 的内核、引擎的公开属性）；各步的入口（run.py、step11 的服务器）、
bench/ 可以 import perf；common/ 不 import perf，也不 import 任何一步（tests/test_layering.py 检查）；
引擎文件（engine.py、scheduler.py……）也不 import perf。
为什么是这个方向：编译的 decode 是套在一个已经造好的引擎外面的东西（engine.model 换成 CompiledDecodeModel），
它要认识引擎，引擎不需要认识它；run.py 是一步最上面的一层，在那里把引擎交给它，每一步的引擎一行不用为它改。
反过来（perf 在 common/ 里）就成了地基依赖第 05 章：common/cli.py 只好在函数里 import 来躲开循环。
"""
