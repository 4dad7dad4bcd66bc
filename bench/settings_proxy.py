"""Settings of the throughput benchmark's server: chatmem's, with the proxy view mounted."""

from chatmem_project.settings import *  # noqa: F403

ROOT_URLCONF = "bench.proxy_urls"
