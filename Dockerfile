# The image of every service of docker-compose.yml: PostgreSQL 15, the Prefect server and worker, the Dask
# scheduler and workers, and prefect-elastic with torch (CPU) in /opt/venv.
#
# Build it with scripts/build-image.sh, which makes what this file needs and no registry can give here:
# the base image (a debootstrapped Debian bookworm with python3, python3-venv and postgresql) and, in
# build/docker, the wheelhouse of the dependencies and the project's wheel. Nothing is downloaded here.
ARG BASE_IMAGE=prefect-elastic/bookworm-base:1

# The virtualenv is made in a stage of its own, so the wheels copied in (about 300 MB) stay out of the
# final image; this stage is rebuilt only when the wheelhouse changes.
FROM ${BASE_IMAGE} AS deps
COPY build/docker/wheels /wheels
# requirements.txt names the wheel files relative to the wheelhouse.
WORKDIR /wheels
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --quiet --no-cache-dir --no-index --find-links /wheels -r requirements.txt

FROM ${BASE_IMAGE} AS final
ENV PATH=/opt/venv/bin:/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    LANG=C.UTF-8
COPY --from=deps /opt/venv /opt/venv
# The project last, and alone: a code change rebuilds only these small layers.
COPY build/docker/dist /tmp/dist
RUN pip install --no-cache-dir --no-index --no-deps /tmp/dist/*.whl && rm -rf /tmp/dist
WORKDIR /opt/prefect-elastic
COPY flows flows
# The digits dataset is part of the image (scikit-learn ships it), so every container reads the same
# shards at the same path with no shared volume; the data directory of PostgreSQL belongs to postgres,
# and a named volume mounted there starts with that owner.
RUN python -c "from prefect_elastic.dataset import digits_dataset; digits_dataset('/opt/prefect-elastic/data/digits', shards=2)" \
 && install -d -o postgres -g postgres /var/lib/postgresql/data \
 && install -d /var/lib/prefect-elastic
