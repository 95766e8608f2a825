import pytest

from trioserve import InferenceServerError, NotFoundError
from trioserve.rest._errors import HttpError
from trioserve.rest._router import Router


@pytest.fixture
def router():
    r: Router[str] = Router()
    r.add("GET", "/v2", "server")
    r.add("GET", "/v2/models/{model}", "metadata")
    r.add("GET", "/v2/models/{model}/versions/{version}", "versioned")
    r.add("POST", "/v2/models/{model}/infer", "infer")
    r.add("GET", "/v2/models/{model}/ready", "ready")
    return r


def test_exact_and_parameterised_paths(router):
    assert router.resolve("GET", "/v2") == ("server", {})
    assert router.resolve("GET", "/v2/models/m") == ("metadata", {"model": "m"})
    assert router.resolve("POST", "/v2/models/m/infer") == ("infer", {"model": "m"})
    assert router.resolve("GET", "/v2/models/m/versions/3") == (
        "versioned",
        {"model": "m", "version": "3"},
    )


@pytest.mark.parametrize(
    "path",
    [
        "/v2/",
        "/v2/models",
        "/v2/models//infer",
        "/v2/models/m/explode",
        "/v3",
        "/v2/models/m/versions",
    ],
)
def test_unknown_paths(router, path):
    with pytest.raises(NotFoundError):
        router.resolve("GET", path)


def test_wrong_method_lists_the_allowed_ones(router):
    with pytest.raises(HttpError) as info:
        router.resolve("GET", "/v2/models/m/infer")
    assert (info.value.status, info.value.headers) == (405, ((b"allow", b"POST"),))
    # A transport error, not one of the core's: no except clause can take it for one.
    assert not isinstance(info.value, InferenceServerError)


@pytest.mark.parametrize("literal_first", [True, False])
def test_the_most_literal_pattern_wins_whatever_the_order(literal_first):
    router: Router[str] = Router()
    routes = [("/v2/models/stats", "all stats"), ("/v2/models/{model}", "metadata")]
    for path, handler in routes if literal_first else reversed(routes):
        router.add("GET", path, handler)
    assert router.resolve("GET", "/v2/models/stats") == ("all stats", {})
    assert router.resolve("GET", "/v2/models/simple") == ("metadata", {"model": "simple"})


def test_every_error_kind_has_one_status_per_transport():
    from trioserve._errors import ErrorKind
    from trioserve.grpc._errors import GRPC_STATUS, GrpcError
    from trioserve.rest._errors import HTTP_STATUS

    assert set(HTTP_STATUS) == set(GRPC_STATUS) == set(ErrorKind)
    # The transports' own errors stand apart from the core's tree.
    assert not issubclass(HttpError, InferenceServerError)
    assert not issubclass(GrpcError, InferenceServerError)
