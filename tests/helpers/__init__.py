"""What the tests share, imported as `from tests.helpers.<module> import <name>` (conftest files keep only fixtures
and hooks):

- early_servers: servers started in the background right after collection;
- servers: a real tritonserver on the qwen_image entry, with the engine's test hooks and a leak check;
- launched: the whole served stack (`serve`) as a fixture;
- streaming: one gRPC stream per request, SSE reading, /metrics scraping;
- front_door: a real front door, the OpenAI SDK pointed at it;
- fake_gateway: an in-process stand-in for the front door's Triton gateway, and hostile JSON values;
- postgres: a throwaway PostgreSQL server;
- waiting: waiting on a condition, or on an engine tick by tick (`TickBudget`);
- scheduling: hand-made requests, ticks and a clock for the scheduler's tests;
- parity_checks, step_cache_checks: the engine's runner driven tick by tick against diffusers' own pipelines;
- hostile_images: the image files a client may send, hostile and odd but valid.
"""
