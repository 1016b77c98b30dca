"""Entry file MLflow logs "from code": loading the model runs this file, which names the
pyfunc class by import (the package must be installed where the model is served), so no
pickled Python object is ever stored in or loaded from the registry."""

from mlflow.models import set_model

from publish.serving import RankingPyfunc

set_model(RankingPyfunc())
