"""The /predict answer beyond the ranked labels: abstaining, explanations,
multi-label sets. Shared by the lean path (fastpath.py), PredictHandler and
the Open Inference Protocol (oip.py). Imports no TensorFlow.

- `min_score` (request, else the model's policy `min_score`): a prediction
  whose top score is below it answers `"label": null, "abstained": true`,
  with its score and `top` still there.
- `explain: k`: each prediction gets the k n-grams that pushed its label most
  (`explanation`), computed in the worker next to the prediction
  (model_worker/explain.py). Asked only then: a request without it costs
  what it cost before.
- Multi-label models (meta.json `multi_label`): `labels` lists every label
  whose score clears its threshold (chosen by cross-validation), best first;
  at least `min_labels` (0 or 1) of them.
"""
from __future__ import annotations

import math
from typing import Any

from frontend.base import ApiError, service_error

# /predict fields beyond text(s), model and top_k
OPTION_FIELDS = {"min_score", "explain"}
MAX_EXPLAIN = 100


def predict_options(data: dict[str, Any]) -> dict[str, Any]:
    """{"min_score": float | None, "explain": int} of a /predict body; 400 when bad."""
    min_score = data.get("min_score")
    if min_score is not None:
        if isinstance(min_score, bool) or not isinstance(min_score, (int, float)) or not (
                0.0 <= float(min_score) <= 1.0) or math.isnan(float(min_score)):
            raise ApiError(400, "invalid_field", "'min_score' must be a number between 0 and 1")
        min_score = float(min_score)
    explain = data.get("explain", 0)
    if explain is None or explain is False:
        explain = 0
    if isinstance(explain, bool) or not isinstance(explain, int) or not 0 <= explain <= MAX_EXPLAIN:
        raise ApiError(400, "invalid_field",
                       f"'explain' must be an integer between 0 (off) and {MAX_EXPLAIN}")
    return {"min_score": min_score, "explain": explain}


# -- what a model version is (from its meta.json, read once per version) -------------
_INFO: dict[tuple[str, Any], dict[str, Any]] = {}
_INFO_CAP = 256


def model_info(sup: Any, model: dict[str, Any]) -> dict[str, Any]:
    """{"multi_label", "thresholds", "min_labels", "explainable", "why"} of a
    served version; plain single-label defaults when its meta cannot be read."""
    key: tuple[Any, Any] = (model.get("name"), model.get("version"))
    info = _INFO.get(key)
    if info is not None:
        return info
    meta: dict[str, Any] = {}
    try:
        meta = sup.store.meta(model["name"], int(model["version"]))
    except Exception:  # a tiny test model or a store hiccup: a plain classifier
        meta = {}
    info = describe_meta(meta)
    if len(_INFO) >= _INFO_CAP:
        _INFO.clear()
    _INFO[key] = info
    return info


def describe_meta(meta: dict[str, Any]) -> dict[str, Any]:
    labels = meta.get("labels") or []
    thresholds: Any = meta.get("thresholds")  # {label: threshold} when multi-label
    multi = bool(meta.get("multi_label")) and isinstance(thresholds, dict)
    params = meta.get("params") or {}
    arch = params.get("architecture")
    chosen = ((meta.get("report") or {}).get("chosen") or {}).get("members") or []
    explainable, why = True, ""
    if arch in ("bow", "cnn"):
        explainable = False
        why = (f"a {arch} model cannot explain its predictions exactly (only the linear "
               "models that architecture 'auto' builds can)")
    elif arch != "auto" or any(m.get("learner") in ("bow", "cnn") for m in chosen):
        explainable = False
        why = "this model is not one of auto's linear models, which alone can explain exactly"
    return {"multi_label": multi,
            "thresholds": [float(thresholds.get(lab, 0.5)) for lab in labels] if multi else None,
            "min_labels": int(meta.get("min_labels", 1)) if multi else 1,
            "explainable": explainable, "why": why}


# -- the model's policy -------------------------------------------------------------------
def policy_min_score(sup: Any, name: str) -> float | None:
    """The `min_score` of the model's policy (PUT /models/<name>/policy), if the
    supervisor keeps policies and this one sets a valid one."""
    policies = getattr(sup, "policies", None)
    get = getattr(policies, "get", None)
    if not callable(get):
        return None
    try:
        policy = get(name)
    except Exception:
        return None
    value = policy.get("min_score") if isinstance(policy, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        return None
    return float(value)


# -- calling the worker ----------------------------------------------------------------
async def scores_for(sup: Any, texts: list[str], name: str | None, explain: int
                     ) -> tuple[dict[str, Any], list[str], list[Any], list[Any] | None]:
    """(model, labels, score rows, explanations or None)."""
    if not explain:
        model, labels, scores = await sup.predict(texts, name)
        return model, labels, scores, None
    serving = sup.serving_model(name)
    if serving is not None:
        info = model_info(sup, serving)
        if not info["explainable"]:
            raise ApiError(422, "cannot_explain", info["why"])
    # through the router like any request (it answers 422 cannot_explain itself)
    model, labels, out = await sup.predict(texts, name, options={"x": explain})
    if isinstance(out, dict):
        return model, labels, out["scores"], out.get("explain")
    return model, labels, out, None


# -- the answer ---------------------------------------------------------------------------
def label_set(row: list[float], info: dict[str, Any], min_score: float | None = None,
              order: list[int] | None = None) -> list[int]:
    """A multi-label model's labels for one row of scores, best first: those
    that clear their threshold (and min_score), at least min_labels of them
    unless min_score is given."""
    if order is None:
        order = sorted(range(len(row)), key=row.__getitem__, reverse=True)
    floor = min_score if min_score is not None else 0.0
    chosen = [i for i in order if row[i] >= max(info["thresholds"][i], floor)]
    if not chosen and info["min_labels"] > 0 and min_score is None:
        chosen = order[:1]  # at least one label: the best, though under its threshold
    return chosen


def prediction(row: list[float], labels: list[str], k: int, info: dict[str, Any],
               min_score: float | None) -> dict[str, Any]:
    order = sorted(range(len(labels)), key=row.__getitem__, reverse=True)
    top: list[dict[str, Any]] = [{"label": labels[i], "score": row[i]} for i in order[:k]]
    p: dict[str, Any] = {"label": top[0]["label"], "score": top[0]["score"], "top": top}
    if info["multi_label"]:
        chosen = label_set(row, info, min_score, order)
        p["labels"] = [{"label": labels[i], "score": row[i]} for i in chosen]
        if min_score is not None:
            p["abstained"] = not chosen
            if not chosen:
                p["label"] = None
    elif min_score is not None:
        p["abstained"] = top[0]["score"] < min_score
        if p["abstained"]:
            p["label"] = None
    return p


async def predict(sup: Any, texts: list[str], top_k: int, name: str | None,
                  options: dict[str, Any] | None = None, keep: list[Any] | None = None
                  ) -> dict[str, Any]:
    """The /predict answer: one prediction per text, in order. keep: a list that
    receives (labels, score rows, k), for the prediction log."""
    options = options or {}
    try:
        model, labels, scores, explained = await scores_for(sup, texts, name,
                                                            options.get("explain", 0))
    except ApiError:
        raise
    except Exception as exc:
        raise service_error(exc) from None
    info = model_info(sup, model)
    min_score = options.get("min_score")
    if min_score is None:
        min_score = policy_min_score(sup, model["name"])
    k = min(top_k, len(labels))
    predictions = [prediction(row, labels, k, info, min_score) for row in scores]
    if keep is not None:
        keep.extend((labels, scores, k))
    if explained is not None:
        for p, e in zip(predictions, explained):
            p["explanation"] = e
    return {"model": model, "predictions": predictions}
