"""An OpenAI Images API front door for the Triton models: `/v1/models`, `/v1/images/generations`, `/edits`,
and `/v1/chat/completions` for the models that answer in text.

A thin async HTTP server (FastAPI + uvicorn) that speaks gRPC streaming to the local
tritonserver through tritonclient's asyncio client; no model code runs in it (it imports
no torch). `make serve` starts it on OPENAI_PORT (default 9000) next to tritonserver.

requests.py  the OpenAI request body -> a model's inputs, and OpenAI-shaped errors
gateway.py   tritonclient.grpc.aio: ready models, their declared inputs, one streamed request
keys.py      bearer keys and the `priority` each may ask for (OPENAI_API_KEY, OPENAI_PRIORITY_KEYS)
app.py       the FastAPI app: endpoints, bearer keys, bounded body reads, server-sent events, client disconnects
chat.py      `/v1/chat/completions` for the models that answer in text (BAGEL)
generate.py  strict versions of Triton's `generate` / `generate_stream`
videos.py    `/v1/videos`: OpenAI's video jobs for the models with an mp4 output
store.py     where jobs and results (mp4s, image URLs' PNGs) outlive the process: SQLite in DIFFUSION_DATA_DIR,
             or PostgreSQL (JOB_STORE_URL) for replicas
files.py     `/v1/files/{id}/content`: a stored result, behind the bearer key that made it
watch.py     waiting for a request's responses while watching its HTTP client
http_limits.py  connection limits a proxy would set: a connection whose headers do not complete in time is closed
__main__.py  `python -m engine_lib.serving.openai_api --triton HOST:PORT --port 9000`
"""
