"""End-to-end acceptance experiments on two real SGLang engines (RFC sections 3.4, 5.2, 7.2, 7.3)."""
