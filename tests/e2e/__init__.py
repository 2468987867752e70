"""End-to-end acceptance experiments on two real SGLang engines.

They prove rules 3.4, 5.2, 7.2 and 7.3 of ``docs/rules.md``.
"""
