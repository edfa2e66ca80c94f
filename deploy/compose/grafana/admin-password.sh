#!/bin/sh
# Entrypoint wrapper of the compose stack's Grafana: give the admin user a real password, then
# exec the image's own start command ("$@", i.e. /run.sh).
#
# The password comes from, in order:
#   1. GRAFANA_ADMIN_PASSWORD (the environment or .env);
#   2. the file admin-password in $KVCACHE_SECRETS_DIR (deploy/compose/secrets/grafana/ on the host);
#   3. otherwise one generated on first start and kept in Grafana's data volume, printed once.
# Grafana applies it when it creates the admin user, i.e. on the first start with an empty
# data volume; later changes go through `grafana cli admin reset-admin-password` (docs/compose.md).
set -eu

secrets_dir=${KVCACHE_SECRETS_DIR:-/run/secrets/kvcache}
data_dir=${GF_PATHS_DATA:-/var/lib/grafana}
generated="$data_dir/kvcache-admin-password"

if [ -n "${GRAFANA_ADMIN_PASSWORD:-}" ]; then
    password=$GRAFANA_ADMIN_PASSWORD
elif [ -s "$secrets_dir/admin-password" ]; then
    password=$(cat "$secrets_dir/admin-password")
elif [ -s "$generated" ]; then
    password=$(cat "$generated")
    echo "kvcache: Grafana admin password: the generated one, in $generated" >&2
else
    password=$(tr -dc 'A-Za-z0-9' </dev/urandom | head -c 24)
    (umask 077 && printf '%s\n' "$password" >"$generated")
    echo "kvcache: generated a Grafana admin password (also kept in $generated): $password" >&2
fi

unset GRAFANA_ADMIN_PASSWORD GF_SECURITY_ADMIN_PASSWORD__FILE
GF_SECURITY_ADMIN_PASSWORD=$password
export GF_SECURITY_ADMIN_PASSWORD
exec "$@"
