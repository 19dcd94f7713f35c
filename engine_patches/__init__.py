"""What runs inside or beside a real SGLang server so it serves kvgate well.

``launch`` builds the SGLang command line for a prefill, decode or unified engine;
``run_server`` is the entrypoint it uses, which applies the patches below and then runs
``sglang.launch_server`` unchanged; ``l3_events`` adds KV events for HiCache's Mooncake
tier. Nothing here imports sglang at module import time except the patch itself.
"""
