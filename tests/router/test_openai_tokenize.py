"""`/tokenize`, `/detokenize` and `/v1/models/{id}` against the service double."""

from __future__ import annotations

from tests.router.fake_service import MODEL, assert_error


def test_tokenize_a_prompt_and_messages(client, fake):
    r = client.post("/tokenize", json={"prompt": "ab"})
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": [97, 98], "count": 2, "max_model_len": 128}
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
    assert fake.messages == [{"role": "user", "content": "hi"}]


def test_tokenize_needs_exactly_one_input(client):
    assert_error(client.post("/tokenize", json={}), 400, "invalid_request_error", "prompt")
    both = {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
    assert_error(client.post("/tokenize", json=both), 400, "invalid_request_error", "prompt")


def test_detokenize_and_its_vocabulary_bound(client):
    r = client.post("/detokenize", json={"tokens": [65, 66]})
    assert r.status_code == 200 and r.json() == {"prompt": "ab"}
    r = client.post("/detokenize", json={"tokens": [1, 512]})
    assert_error(r, 400, "invalid_request_error", "tokens")


def test_one_model_by_id_and_an_unknown_one(client):
    r = client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
