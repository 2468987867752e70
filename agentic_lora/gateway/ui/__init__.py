"""The gateway's status page for operators: ``GET /ui/`` on ``agentic-lora serve``.

* :mod:`~agentic_lora.gateway.ui.view`: the page's data, built I/O-free from a registry status
  and the gateway's state (paged and summarised: its size does not grow with Sessions).
* :mod:`~agentic_lora.gateway.ui.activity`: bounded records of recent publications, reclaims
  and refused requests.
* :mod:`~agentic_lora.gateway.ui.auth`: logins that exchange the admin token for a cookie.
* :mod:`~agentic_lora.gateway.ui.routes`: the HTTP routes; the page itself is static HTML, CSS
  and JavaScript shipped in ``static/``.

Only ``routes`` imports the ASGI stack.
"""

__all__: list[str] = []
