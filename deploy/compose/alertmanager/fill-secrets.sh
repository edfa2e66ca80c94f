#!/bin/sh
# Entrypoint wrapper of the compose stack's Alertmanager. Its configuration cannot read the
# environment, only files (the *_file fields of alerts/alertmanager.yml, which name
# /etc/alertmanager/secrets/<name>). This fills that directory, a tmpfs, then execs "$@":
#   1. every file of $KVCACHE_SECRETS_SOURCE (deploy/compose/secrets/alertmanager/ on the host);
#   2. every non-empty ALERTMANAGER_SECRET_<NAME> variable, as the file <name> in lower case with
#      dashes (ALERTMANAGER_SECRET_SLACK_WEBHOOK_URL -> slack-webhook-url); it wins over a file.
# A receiver whose file is absent does not stop Alertmanager: only its notifications fail.
set -eu

source_dir=${KVCACHE_SECRETS_SOURCE:-/run/kvcache-secrets}
secrets_dir=${KVCACHE_SECRETS_DIR:-/etc/alertmanager/secrets}
umask 077

for file in "$source_dir"/*; do
    case "$file" in
        *.md | *.example) ;;  # the directory's documentation and templates
        *) if [ -f "$file" ]; then cp "$file" "$secrets_dir/"; fi ;;
    esac
done

# Names are [A-Z0-9_] only (the sed pattern), so eval reads a variable and nothing else.
for name in $(env | sed -n 's/^ALERTMANAGER_SECRET_\([A-Z0-9_]*\)=.*/\1/p'); do
    eval "value=\${ALERTMANAGER_SECRET_$name}"
    if [ -n "$value" ]; then
        printf '%s' "$value" >"$secrets_dir/$(echo "$name" | tr 'A-Z_' 'a-z-')"
    fi
done

exec "$@"
