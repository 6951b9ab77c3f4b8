#!/bin/sh
# Test certificates for the TLS tests (crates/cli/tests/bad_input.rs, crates/runtime/src/tls.rs):
# a cluster CA and a node certificate it signed (SAN IP:127.0.0.1, DNS:localhost; serverAuth
# and clientAuth, so one certificate serves both ends), and a second CA with a certificate of
# its own (a peer of another cluster). ECDSA P-256, valid for 100 years. Run in this directory.
set -eu
days=36500
ext=$(mktemp)
trap 'rm -f "$ext" ./*.csr ./*.srl' EXIT
printf '%s\n' 'basicConstraints=critical,CA:FALSE' 'keyUsage=critical,digitalSignature' \
    'extendedKeyUsage=serverAuth,clientAuth' 'subjectAltName=IP:127.0.0.1,DNS:localhost' >"$ext"
for pair in "ca node" "other-ca other"; do
    set -- $pair
    openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8 -topk8 -nocrypt -out "$1.key"
    openssl req -x509 -new -key "$1.key" -sha256 -days $days -subj "/CN=elasticps test $1" \
        -addext 'basicConstraints=critical,CA:TRUE' -addext 'keyUsage=critical,keyCertSign,cRLSign' -out "$1.pem"
    openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8 -topk8 -nocrypt -out "$2.key"
    openssl req -new -key "$2.key" -subj "/CN=elasticps test $2" -out "$2.csr"
    openssl x509 -req -in "$2.csr" -CA "$1.pem" -CAkey "$1.key" -CAcreateserial -sha256 -days $days \
        -extfile "$ext" -out "$2.pem"
done
