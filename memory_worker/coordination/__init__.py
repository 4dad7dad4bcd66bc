"""Coordinating memory work across processes: the chat's lock and the lease its holder keeps,
the process's Redis handles (short timeouts and a breaker on the request path), how a fold is
handed on (MEMORY_DISPATCH, the queued marker) and the deadlines every task and call keeps."""
