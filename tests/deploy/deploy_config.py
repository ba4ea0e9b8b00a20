"""The run config the deploy tests render: two explorers, a reward service, Curve keys."""

from __future__ import annotations

SERVER_SECRET = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"
CLIENT_SECRET = "D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%cs"


def run_config(**sections) -> dict:
    data = {
        "name": "demo",
        "model": {"path": "/models/qwen"},
        "sync": {"preset": "fully_async"},
        "master": {"taskset": {"path": "/data/tasks.jsonl"}},
        "explorers": [{"name": "explorer-0", "batch_size": 4},
                      {"name": "explorer-1", "batch_size": 4}],
        "reward": {"service": True},
        "weights": {"transport": "fetch"},
        "transport": {"curve": {
            "server_public": "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7",
            "server_secret": SERVER_SECRET,
            "client_public": "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID",
            "client_secret": CLIENT_SECRET}},
    }
    data.update(sections)
    return data
